//! The iptables programs: which variant the system uses, and `iptables-save` /
//! `iptables-restore --noflush` runs (input on stdin, errors with the offending line).
use std::{
    fmt,
    process::Command,
    time::{Duration, Instant},
};

use anyhow::{anyhow, bail, Context as _};

use super::ruleset::{Family, TableName};
use crate::tool;

/// How long iptables waits for the xtables lock (legacy; nft ignores it), in seconds.
const LOCK_WAIT_SECONDS: &str = "5";

/// The two implementations of the iptables commands. Rules of one are invisible to the other,
/// so vipr must use the one the rest of the system (kubelet, the CNI) uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    /// The x_tables kernel interface (`iptables-legacy`).
    Legacy,
    /// nf_tables through the compatibility layer (`iptables-nft`).
    Nft,
}

impl Variant {
    pub fn name(self) -> &'static str {
        match self {
            Self::Legacy => "legacy",
            Self::Nft => "nft",
        }
    }

    /// From `iptables --version`: `iptables v1.8.9 (nf_tables)` or `iptables v1.8.9 (legacy)`;
    /// versions before 1.8 have no suffix and are legacy.
    pub fn from_version_output(text: &str) -> Option<Self> {
        if !text.contains("iptables") {
            return None;
        }
        Some(if text.contains("nf_tables") { Self::Nft } else { Self::Legacy })
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// The programs of one variant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tools {
    pub variant: Variant,
    /// `iptables --version`'s numbers.
    pub version: (u32, u32, u32),
    /// Call `iptables-legacy-restore` etc. rather than the system's `iptables-restore`.
    explicit: bool,
}

impl Tools {
    /// The system's variant (what `iptables` is), or `forced`'s programs
    /// (`iptables-legacy-*`, `iptables-nft-*`).
    pub fn detect(forced: Option<Variant>) -> anyhow::Result<Self> {
        let explicit = forced.is_some();
        let program = match forced {
            Some(variant) => format!("iptables-{}", variant.name()),
            None => "iptables".to_owned(),
        };
        let output = tool::run(Command::new(&program).arg("--version"), None, tool::QUERY_TIMEOUT)
            .context("is iptables installed?")?;
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        let variant = Variant::from_version_output(&text)
            .ok_or_else(|| anyhow!("{program} --version printed {text:?}, not an iptables version"))?;
        if forced.is_some_and(|forced| forced != variant) {
            bail!(
                "{program} is the {variant} variant, not {}",
                forced.map(Variant::name).unwrap_or_default()
            );
        }
        Ok(Self { variant, version: parse_version(&text).unwrap_or((0, 0, 0)), explicit })
    }

    /// `MASQUERADE --random-fully` exists from iptables 1.6.2 on.
    pub fn has_random_fully(&self) -> bool {
        self.version >= (1, 6, 2)
    }

    /// `iptables`, `ip6tables-save`, `iptables-nft-restore`, ...
    pub fn program(&self, family: Family, tool: Option<&str>) -> String {
        let mut name = command(family).to_owned();
        if self.explicit {
            name.push('-');
            name.push_str(self.variant.name());
        }
        if let Some(tool) = tool {
            name.push('-');
            name.push_str(tool);
        }
        name
    }

    /// `iptables-save` of every table of `family`.
    pub fn save(&self, family: Family) -> anyhow::Result<String> {
        let program = self.program(family, Some("save"));
        tool::run(&mut Command::new(&program), None, tool::RULESET_TIMEOUT)?.stdout_if_success(&program)
    }

    /// `iptables-save -c -t TABLE`: one table of `family`, each rule with its
    /// `[packets:bytes]` counters.
    pub fn save_counted(&self, family: Family, table: TableName) -> anyhow::Result<String> {
        let program = self.program(family, Some("save"));
        tool::run(Command::new(&program).args(["-c", "-t", table.as_str()]), None, tool::QUERY_TIMEOUT)?
            .stdout_if_success(&program)
    }

    /// `iptables-restore --noflush` with `input`; returns how long it took.
    pub fn restore(&self, family: Family, input: &str) -> anyhow::Result<Duration> {
        let program = self.program(family, Some("restore"));
        let started = Instant::now();
        let output = tool::run(
            Command::new(&program).args(["--noflush", "-w", LOCK_WAIT_SECONDS]),
            Some(input.as_bytes()),
            tool::RULESET_TIMEOUT,
        )?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            bail!(
                "{program} failed ({}): {}{}",
                output.status,
                stderr.trim(),
                offending_line(&stderr, input)
            );
        }
        Ok(started.elapsed())
    }
}

/// The command prefix of a family: `iptables` or `ip6tables`.
pub fn command(family: Family) -> &'static str {
    match family {
        Family::Ipv4 => "iptables",
        Family::Ipv6 => "ip6tables",
    }
}

fn parse_version(text: &str) -> Option<(u32, u32, u32)> {
    let version = text.split_whitespace().find_map(|word| word.strip_prefix('v'))?;
    let mut numbers = version.split('.').map(|part| part.parse::<u32>().ok());
    Some((numbers.next()??, numbers.next()??, numbers.next().flatten().unwrap_or(0)))
}

/// `iptables-restore` says `Error occurred at line: N`; quote that line of the input.
fn offending_line(stderr: &str, input: &str) -> String {
    let line = stderr
        .lines()
        .find_map(|line| line.trim().strip_prefix("Error occurred at line:"))
        .and_then(|number| number.trim().parse::<usize>().ok());
    match line.and_then(|number| input.lines().nth(number.checked_sub(1)?)) {
        Some(text) => format!(" [input line: {text}]"),
        None => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_and_versions_are_read_from_version_output() {
        assert_eq!(Variant::from_version_output("iptables v1.8.9 (nf_tables)\n"), Some(Variant::Nft));
        assert_eq!(Variant::from_version_output("iptables v1.8.9 (legacy)\n"), Some(Variant::Legacy));
        assert_eq!(Variant::from_version_output("iptables v1.6.1\n"), Some(Variant::Legacy));
        assert_eq!(Variant::from_version_output("bash: not found"), None);
        assert_eq!(parse_version("iptables v1.8.9 (legacy)"), Some((1, 8, 9)));
        assert_eq!(parse_version("iptables v1.6"), Some((1, 6, 0)));
    }

    #[test]
    fn program_names_follow_family_variant_and_tool() {
        let system = Tools { variant: Variant::Nft, version: (1, 8, 9), explicit: false };
        assert_eq!(system.program(Family::Ipv6, Some("restore")), "ip6tables-restore");
        let forced = Tools { explicit: true, ..system.clone() };
        assert_eq!(forced.program(Family::Ipv4, Some("save")), "iptables-nft-save");
        assert_eq!(forced.program(Family::Ipv4, None), "iptables-nft");
        assert!(system.has_random_fully());
    }

    #[test]
    fn a_restore_error_quotes_the_input_line() {
        let input = "*nat\n:KUBE-X - [0:0]\n-A KUBE-X -j NOPE\nCOMMIT\n";
        let stderr = "iptables-restore: line 3 failed\nError occurred at line: 3\n";
        assert_eq!(offending_line(stderr, input), " [input line: -A KUBE-X -j NOPE]");
        assert_eq!(offending_line("other", input), "");
    }
}
