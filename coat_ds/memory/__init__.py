"""Where memory goes: the tensors this rank holds and the bytes behind them (`tensors`), and
the bytes a region of code allocates, read from the CUDA allocator or, on a CPU, a storage
tracker (`meters`). The profiler and the planner both measure with them."""
from .meters import CudaMeter, Meter, StorageMeter, meter_for, resident_bytes, saved_tensor_bytes
from .tensors import local_tensor, unique_storage_bytes

__all__ = ["Meter", "CudaMeter", "StorageMeter", "meter_for", "resident_bytes", "saved_tensor_bytes", "local_tensor",
           "unique_storage_bytes"]
