"""The worklogs' kernels: the fast Triton kernels with every experiment the worklog notebooks measure.

`triton_forward` is utils.tiled.fast.forward with notebook 05b's switches (Steps: autotune, TMA made per program or
by the host, the overlapped loop, exponentials on the FMA units) and its worklog (WORKLOG, variant,
SWEEP_CONFIGS). `triton_backward` is utils.tiled.fast.backward with worklog 07w's forced loads (tma, tma_stats)
and its ways of adding dQ in the dK/dV pass (dq_atomic). At the registry's settings (switches off) they compile
to the same code as the fast modules (tests/test_fast_identity.py). Kernel code never imports them.
"""
