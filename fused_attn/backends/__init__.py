"""The backends, registered in the order the automatic choice prefers them."""

from . import registry
from .reference import ReferenceBackend
from .triton import TritonBackend

registry.register(TritonBackend())
registry.register(ReferenceBackend())
