"""TPU pods: ahead-of-time fit checks, the launcher, the multi-controller runtime."""
