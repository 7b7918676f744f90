"""Writers stream tensors into a checkpoint directory; they never see readers."""
