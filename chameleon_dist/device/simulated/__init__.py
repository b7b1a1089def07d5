"""The simulated backend: a GPU's timing and memory, on the CPU (NOTE [One device code path] in
``device/backend.py``; NOTE [The simulated device clock] in ``clock.py``)."""
