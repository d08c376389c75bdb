// Kernel programs live in main.rs (a bin built for bpfel-unknown-none by aya-build). This
// empty library exists so proxy-userspace can name proxy-ebpf as a build-dependency and be
// rebuilt whenever the kernel code changes.
#![no_std]
