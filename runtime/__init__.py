"""Loading compiled kernels, devices, input checks, and the float64 reference."""

from .devices import cuda_available, device_available, get_device
from .errors import InputError
from .kernels import Kernel, open_kernel

__all__ = ["cuda_available", "device_available", "get_device", "InputError", "Kernel", "open_kernel"]
