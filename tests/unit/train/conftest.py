"""One torch thread: these tests use tiny tensors, and on a loaded 2-core machine a second thread only spins."""
import torch

torch.set_num_threads(1)
