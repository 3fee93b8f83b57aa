"""Several processes, one run: who this process is (environment), joining through
jax.distributed with a roll call (runtime, rendezvous), faked CPU devices (devices), stopping
cleanly on SIGTERM (preemption) and the local launcher (launcher)."""
