//! The external programs vipr, its tests, the demo, the benchmarks and the conformance runner
//! start, and the guard that keeps `cargo xtask setup` installing every one of them.
//!
//! CI runs on the machine of the session that submitted, so a package installed there by hand
//! hides a missing install step until a fresh machine runs the suite (it happened with `nft`).
//! The guard reads the workspace's sources for the places that start a program by name and
//! fails when one of them is not in [`EXTERNAL_PROGRAMS`], or when the package providing it is
//! not one setup installs.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

/// Where a program comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Provider {
    /// A Debian package, installed by setup unless it is part of every Debian system
    /// ([`BASE_SYSTEM_PACKAGES`]).
    Debian(&'static str),
    /// rustup's toolchains (cargo, rustc, rustup itself) or what setup builds with them.
    RustToolchain,
    /// A binary of this workspace, built by `cargo build`.
    Workspace,
    /// Built from source by setup, off PATH (vipr's User-Mode Linux kernel, uml_kernel.rs).
    BuiltBySetup,
}

/// Every program started by name, whether the sources name it literally (found by [`scan`]),
/// build its name (`iptables-nft-restore`) or start it from a script (UML's init). The guard
/// also checks that each one is on PATH once setup has run, so a wrong package shows.
pub const EXTERNAL_PROGRAMS: &[(&str, Provider)] = &[
    // Network namespaces, links, routes, addresses.
    ("ip", Provider::Debian("iproute2")),
    // Inspecting loaded programs and maps.
    ("bpftool", Provider::Debian("bpftool")),
    // The iptables dataplane and the netfilter baselines: the system's variant and both
    // variants by name, as `Tools::program` builds them.
    ("iptables", Provider::Debian("iptables")),
    ("ip6tables", Provider::Debian("iptables")),
    ("iptables-save", Provider::Debian("iptables")),
    ("iptables-restore", Provider::Debian("iptables")),
    ("ip6tables-save", Provider::Debian("iptables")),
    ("ip6tables-restore", Provider::Debian("iptables")),
    ("iptables-legacy", Provider::Debian("iptables")),
    ("ip6tables-legacy", Provider::Debian("iptables")),
    ("iptables-legacy-save", Provider::Debian("iptables")),
    ("iptables-legacy-restore", Provider::Debian("iptables")),
    ("ip6tables-legacy-save", Provider::Debian("iptables")),
    ("ip6tables-legacy-restore", Provider::Debian("iptables")),
    ("iptables-nft", Provider::Debian("iptables")),
    ("iptables-nft-save", Provider::Debian("iptables")),
    ("iptables-nft-restore", Provider::Debian("iptables")),
    ("ip6tables-nft-save", Provider::Debian("iptables")),
    ("ip6tables-nft-restore", Provider::Debian("iptables")),
    // The ipvs dataplane's sets.
    ("ipset", Provider::Debian("ipset")),
    // sctp_raw's router rewrites packets with nftables.
    ("nft", Provider::Debian("nftables")),
    // The IPVS kernel for the ipvs mode's tests, and what setup builds it with.
    ("linux.uml", Provider::BuiltBySetup),
    ("make", Provider::Debian("build-essential")),
    ("dpkg-deb", Provider::Debian("dpkg")),
    // vipr's container image: building it (`cargo xtask image`) and running it in the tests;
    // podman starts runc by the name in its containers.conf.
    ("podman", Provider::Debian("podman")),
    ("runc", Provider::Debian("runc")),
    ("buildah", Provider::Debian("buildah")),
    ("debootstrap", Provider::Debian("debootstrap")),
    ("strip", Provider::Debian("binutils")),
    ("tar", Provider::Debian("tar")),
    ("umount", Provider::Debian("mount")),
    // A process in namespaces of its own: xdp_e2e.rs starts an agent under it, host_traffic.rs
    // a client in a cgroup namespace (from a shell script, which the scan does not read).
    ("unshare", Provider::Debian("util-linux")),
    ("xtask", Provider::Workspace),
    // The benchmarks' run metadata.
    ("git", Provider::Debian("git")),
    // setup itself, xtask's own helpers.
    ("dpkg-query", Provider::Debian("dpkg")),
    ("apt-get", Provider::Debian("apt")),
    ("mount", Provider::Debian("mount")),
    ("sh", Provider::Debian("dash")),
    ("sleep", Provider::Debian("coreutils")),
    ("cargo", Provider::RustToolchain),
    ("rustc", Provider::RustToolchain),
    ("rustup", Provider::RustToolchain),
    ("bpf-linker", Provider::RustToolchain),
    ("vipr", Provider::Workspace),
    ("vipr-demo", Provider::Workspace),
    ("vipr-conformance", Provider::Workspace),
    ("vipr-bench", Provider::Workspace),
];

/// Packages of priority "required": every Debian system has them, debootstrap's minbase too.
pub const BASE_SYSTEM_PACKAGES: &[&str] = &["dpkg", "apt", "mount", "dash", "coreutils", "tar", "util-linux"];

/// Calls that start the program named by one of their arguments: the callee as written just
/// before `(`, and which argument (from 0) is the program. A new way of starting programs by
/// name is one more line here.
const SPAWNING_CALLS: &[(&str, usize)] = &[
    // std::process::Command, also written `std::process::Command::new`.
    ("Command::new", 0),
    // testbed's `Netns::command(program)`.
    (".command", 0),
    // The tests' `run_in(netns, program, args)` and `run(netns, program, args)`.
    ("run_in", 1),
    ("run", 1),
    // The e2e bench's `version(program)`.
    ("version", 0),
];

/// A program named literally where it is started.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StartedProgram {
    pub program: String,
    /// `file:line`, for the guard's message.
    pub at: String,
}

/// The programs named literally in `source`'s spawning calls ([`SPAWNING_CALLS`]). Comment
/// lines are skipped, so prose about a program does not count.
pub fn scan(source: &str, file: &str) -> Vec<StartedProgram> {
    let code: String = source
        .lines()
        .map(|line| if line.trim_start().starts_with("//") { "" } else { line })
        .collect::<Vec<_>>()
        .join("\n");
    let mut found = Vec::new();
    for &(callee, argument) in SPAWNING_CALLS {
        let pattern = format!("{callee}(");
        let mut from = 0;
        while let Some(offset) = code[from..].find(&pattern) {
            let start = from + offset;
            from = start + pattern.len();
            // A bare name must stand alone: `run(` is not `netns.run(` or `cmd_run(`, and
            // `version(` is not `parse_version(`.
            let bare_name = !callee.starts_with('.') && !callee.contains("::");
            let preceded_by_name = code[..start]
                .chars()
                .next_back()
                .is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '.');
            if bare_name && preceded_by_name {
                continue;
            }
            let Some(program) = arguments(&code[from..]).get(argument).and_then(|arg| string_literal(arg))
            else {
                continue;
            };
            let line = code[..start].matches('\n').count() + 1;
            found.push(StartedProgram { program, at: format!("{file}:{line}") });
        }
    }
    found
}

/// The top-level arguments of a call whose text (after its `(`) starts `text`.
fn arguments(text: &str) -> Vec<&str> {
    let mut args = Vec::new();
    let (mut depth, mut in_string, mut escaped, mut arg_start) = (0usize, false, false, 0);
    for (index, c) in text.char_indices() {
        if in_string {
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth == 0 => {
                args.push(text[arg_start..index].trim());
                return args;
            }
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                args.push(text[arg_start..index].trim());
                arg_start = index + 1;
            }
            _ => {}
        }
    }
    args
}

/// `"name"` -> `name`; anything else (a variable, a `format!`) is not a literal name.
fn string_literal(arg: &str) -> Option<String> {
    let inner = arg.strip_prefix('"')?.strip_suffix('"')?;
    (!inner.is_empty() && !inner.contains(['"', '\\', '{', ' '])).then(|| inner.to_owned())
}

/// Every `.rs` file of the workspace's crates, but the build output and this file, whose
/// tests quote spawning calls.
pub fn workspace_sources(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    let mut pending: Vec<PathBuf> = ["proxy-common", "proxy-ebpf", "proxy-userspace", "tests", "xtask"]
        .iter()
        .map(|crate_dir| root.join(crate_dir))
        .collect();
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()))? {
            let path = entry?.path();
            if path.is_dir() {
                if path.file_name().is_some_and(|name| name != "target") {
                    pending.push(path);
                }
            } else if path.extension().is_some_and(|ext| ext == "rs") && !path.ends_with(file!()) {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// What is wrong between the programs the sources start and the packages setup installs:
/// empty when every started program is listed and every listed package is installed.
pub fn problems(started: &[StartedProgram], installed_packages: &[&str]) -> Vec<String> {
    let mut problems = Vec::new();
    let listed: BTreeSet<&str> = EXTERNAL_PROGRAMS.iter().map(|(program, _)| *program).collect();
    for unlisted in started.iter().filter(|started| !listed.contains(started.program.as_str())) {
        problems.push(format!(
            "{} starts `{}`, which xtask/src/programs.rs does not list with the package providing it",
            unlisted.at, unlisted.program
        ));
    }
    for (program, provider) in EXTERNAL_PROGRAMS {
        let Provider::Debian(package) = provider else { continue };
        if !installed_packages.contains(package) && !BASE_SYSTEM_PACKAGES.contains(package) {
            problems.push(format!(
                "`{program}` comes from the Debian package {package}, which `cargo xtask setup` does not install"
            ));
        }
    }
    problems
}

/// Whether `program` is an executable file in one of `PATH`'s directories.
pub fn on_path(program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt as _;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(program))
        .any(|candidate| {
            candidate.metadata().is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::setup::DEBIAN_PACKAGES;

    fn workspace_root() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
    }

    fn started_by_the_workspace() -> Vec<StartedProgram> {
        let root = workspace_root();
        let mut started = Vec::new();
        for file in workspace_sources(&root).unwrap() {
            let source = std::fs::read_to_string(&file).unwrap();
            let relative = file.strip_prefix(&root).unwrap().display().to_string();
            started.extend(scan(&source, &relative));
        }
        started
    }

    #[test]
    fn every_program_the_workspace_starts_is_installed_by_setup() {
        let started = started_by_the_workspace();
        // The scan itself must keep finding the programs it is there for.
        for expected in ["ip", "nft", "ipset", "bpftool", "iptables"] {
            assert!(
                started.iter().any(|s| s.program == expected),
                "the scan no longer finds `{expected}`: {started:?}"
            );
        }
        let problems = problems(&started, DEBIAN_PACKAGES);
        assert!(problems.is_empty(), "setup drifted from what the code starts:\n{}", problems.join("\n"));
    }

    #[test]
    fn the_guard_fails_when_a_needed_package_leaves_setup() {
        let started = started_by_the_workspace();
        let without_nftables: Vec<&str> =
            DEBIAN_PACKAGES.iter().copied().filter(|package| *package != "nftables").collect();
        let problems = problems(&started, &without_nftables);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].contains("`nft`") && problems[0].contains("nftables"), "{problems:?}");
    }

    #[test]
    fn the_guard_fails_when_the_code_starts_an_unlisted_program() {
        let mut started = started_by_the_workspace();
        started.extend(scan("fn f() { netns.command(\"tshark\").unwrap(); }", "new.rs"));
        let problems = problems(&started, DEBIAN_PACKAGES);
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert!(problems[0].starts_with("new.rs:1 starts `tshark`"), "{problems:?}");
    }

    /// After `cargo xtask setup` (the test command's first step), every listed program runs:
    /// this catches a program listed under the wrong package.
    #[test]
    fn every_listed_system_program_is_on_path_after_setup() {
        let missing: Vec<&str> = EXTERNAL_PROGRAMS
            .iter()
            .filter(|(_, provider)| matches!(provider, Provider::Debian(_)))
            .map(|(program, _)| *program)
            .filter(|program| !on_path(program))
            .collect();
        assert!(missing.is_empty(), "not on PATH (run `cargo xtask setup`): {missing:?}");
    }

    #[test]
    fn the_scan_reads_spawning_calls_and_skips_prose_and_variables() {
        let source = r#"
            // Command::new("commented")
            let a = Command::new("ip").args(["link"]);
            let b = std::process::Command::new(program);
            let c = netns.command("nft")?;
            run_in(lab.router(), "iptables", &["-A", "FORWARD"]);
            run(node, "ipset", &["list"]).unwrap();
            cmd::run(Command::new("bpftool").args(["prog"]));
            let d = parse_version("1.8.9");
            let e = self.family.command(CMD_FLUSH, &attributes);
        "#;
        let programs: Vec<String> = scan(source, "f.rs").into_iter().map(|s| s.program).collect();
        assert_eq!(programs, ["ip", "bpftool", "nft", "iptables", "ipset"]);
        assert_eq!(scan("x\nCommand::new(\"ip\")", "f.rs")[0].at, "f.rs:2");
    }
}
