"""The interface every I/O engine implements."""

import abc
from concurrent.futures import Future


class Engine(abc.ABC):
    """Moves bytes between memory and spill files, asynchronously."""

    name: str = "?"

    @abc.abstractmethod
    def write(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Write ``nbytes`` from memory at ``address`` to ``file`` at ``offset``."""

    @abc.abstractmethod
    def read(self, file, offset: int, address: int, nbytes: int) -> Future:
        """Read ``nbytes`` from ``file`` at ``offset`` into memory at ``address``."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Finish queued requests and stop the workers."""
