"""Feed the GPU: DataModule, uint8 folders, HDF5, DALI, GPU-side augmentation, worker tuning."""
