"""What partita runs on, apart from the engine: the device (`accelerator`), where this process
sits in the job (`cluster_env`, read from the launcher's variables), every ``PARTITA_*``
variable (`env`), the small C++ helpers built on first use (`native`) and the caching host
allocator among them (`host_cache`), and the ordered shutdown at interpreter exit (`shutdown`).

Imported by the launcher CLI (a fast ``--help``) and, through `partita.platform.env`, by the
start-up hook that runs at interpreter start: this file imports nothing.
"""
