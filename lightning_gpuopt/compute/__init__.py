"""Make the GPU's work cheaper: channels_last, mixed precision, TF32, cuDNN autotuning."""
