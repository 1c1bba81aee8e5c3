"""Where workloads come from: importers of public trace formats (`importers/`: Mooncake, Bailian),
which write trace directories, and the built-in workloads (`workloads/`: fork-tree, hold-stress, the
demo's agent workload), which every command taking `--scenario` can analyse without a trace."""
