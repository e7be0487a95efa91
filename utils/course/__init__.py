"""The course's own machinery: notebook bootstrap, plotting, tests' helpers, exercise checks, benchmarks,
the GPU suite, stored references, cross-compilation, the learner generator. Kernel code never imports it."""
