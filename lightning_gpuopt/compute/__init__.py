"""Make the GPU's work cheaper: precision, TF32, cuDNN autotuning, channels_last, fused optimizers,
``torch.compile`` when it pays, and DDP's settings (``fast_trainer_kwargs`` picks them all)."""
