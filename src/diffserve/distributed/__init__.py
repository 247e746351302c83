"""Multi-device execution over torch.distributed: process groups, launch, sequence/CFG/tensor parallel."""
