"""The backends, registered in the order the automatic choice prefers them."""

from . import registry
from .cpu import CpuBackend
from .cuda import CudaBackend
from .reference import ReferenceBackend
from .triton import TritonBackend

registry.register(TritonBackend())
registry.register(CudaBackend())
registry.register(CpuBackend())
registry.register(ReferenceBackend())
