"""Real parts for the tests and the benchmarks: brokers, databases, servers, models, devices.

Both `tests/` and `bench/` import from here, never from each other. Nothing here is shipped (the
wheel holds only the product packages), and nothing here imports `tests` or `bench`.
"""
