"""Native replay of KV restorations: payload stores and journals, routes (host, host_fixed, cufile,
dmabuf_fixed) over a C io_uring engine, and the paired, verified run protocol.

Modules: `store` (prepare/open stores), `_lib` (the ctypes binding of native/replay.c), `codes` (the one
mapping of its return codes, errno, CUDA and cuFile, into messages), `routes`,
`cufile`, `dmabuf` (the routes and their probes), `gpu` (the device arena and consumer), `blockdev`
(FIEMAP, the device under a path), `runner` (the protocol and results). Importing this package loads
nothing heavy: numpy, pyarrow and the standard library only; PyTorch and cuda-python load lazily.
"""
