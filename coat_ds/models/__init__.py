"""The reference Llama the profiler's presets, the planner and train.py build (`llama`)."""
