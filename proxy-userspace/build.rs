//! Builds proxy-ebpf for bpfel-unknown-none (nightly + bpf-linker, installed by
//! `cargo xtask setup`) and leaves the object in OUT_DIR, where `include_bytes_aligned!`
//! embeds it into the vipr binary: one file to ship, and the kernel code can never be a
//! different version from the agent that drives its maps.
use std::path::PathBuf;

fn main() -> anyhow::Result<()> {
    let manifest_dir = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?);
    let ebpf_dir = manifest_dir.join("../proxy-ebpf");
    let ebpf_dir =
        ebpf_dir.to_str().ok_or_else(|| anyhow::anyhow!("non-UTF-8 path {}", ebpf_dir.display()))?;
    println!("cargo:rerun-if-changed={}", manifest_dir.join("../proxy-common/src").display());
    aya_build::build_ebpf(
        [aya_build::Package { name: "proxy-ebpf", root_dir: ebpf_dir, ..Default::default() }],
        aya_build::Toolchain::default(),
    )
}
