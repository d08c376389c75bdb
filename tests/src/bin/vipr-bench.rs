//! `vipr-bench`: vipr's benchmark suites, run by `cargo xtask bench` (see docs/benchmarks.md).

#[path = "../bench/mod.rs"]
mod bench;

fn main() -> std::process::ExitCode {
    bench::main()
}
