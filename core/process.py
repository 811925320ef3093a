"""Whether this process is the `hpckpt` command (one job, then exit) or a program importing
hpckpt: only the command may change process-wide settings such as resource limits while it
reads (`core.safety.unpickle` bounds the address space a large pickle's load may take). A tiny module,
so that the command line sets it without importing anything heavy."""

single_job = False
