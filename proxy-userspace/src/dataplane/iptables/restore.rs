//! `iptables-restore --noflush` transactions: what a sync writes (all of vipr's chains on a
//! full sync, only the chains whose rules changed on a partial one), what `--cleanup` removes,
//! and reading `iptables-save` output to find what exists. Pure, so it is unit-tested.
//!
//! In `--noflush` mode a chain line (`:KUBE-SVC-X - [0:0]`) creates the chain or flushes it,
//! rules follow with `-A`, and a chain is deleted by declaring (flushing) it and then `-X`:
//! the whole input is one transaction per table, so a packet sees the old rules or the new.
use std::{
    collections::{BTreeMap, BTreeSet},
    fmt::Write as _,
};

use super::{
    names::is_service_chain,
    ruleset::{Jump, Ruleset, TableName, JUMPS, KUBE_FIREWALL, LOCALNET_GUARD, LOCALNET_GUARD_JUMPS},
};

/// kube-proxy's canary chain (mangle, nat, filter), which vipr does not create but removes with
/// kube-proxy's chains: where it exists, the chains are kube-proxy's.
pub const KUBE_PROXY_CANARY: &str = "KUBE-PROXY-CANARY";

/// One table as `iptables-save` shows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SavedTable {
    /// Every chain, and whether it is built in (has a policy).
    pub chains: BTreeMap<String, bool>,
    /// Rules in order: (chain, the rule without `-A CHAIN `).
    pub rules: Vec<(String, String)>,
}

impl SavedTable {
    pub fn user_chains(&self) -> impl Iterator<Item = &str> {
        self.chains.iter().filter(|(_, builtin)| !**builtin).map(|(name, _)| name.as_str())
    }

    fn is_builtin(&self, chain: &str) -> bool {
        self.chains
            .get(chain)
            .copied()
            .unwrap_or(matches!(chain, "PREROUTING" | "INPUT" | "FORWARD" | "OUTPUT" | "POSTROUTING"))
    }
}

/// Reads `iptables-save` output: table name -> table.
pub fn parse_save(text: &str) -> BTreeMap<String, SavedTable> {
    let mut tables = BTreeMap::new();
    let mut current: Option<(String, SavedTable)> = None;
    for line in text.lines() {
        let line = line.trim_end();
        if let Some(name) = line.strip_prefix('*') {
            if let Some((name, table)) = current.take() {
                tables.insert(name, table);
            }
            current = Some((name.to_owned(), SavedTable::default()));
        } else if line == "COMMIT" {
            if let Some((name, table)) = current.take() {
                tables.insert(name, table);
            }
        } else if let Some((_, table)) = current.as_mut() {
            if let Some(declaration) = line.strip_prefix(':') {
                let mut parts = declaration.split_whitespace();
                if let (Some(name), Some(policy)) = (parts.next(), parts.next()) {
                    table.chains.insert(name.to_owned(), policy != "-");
                }
            } else if let Some(rule) = line.strip_prefix("-A ") {
                if let Some((chain, rest)) = rule.split_once(' ') {
                    table.rules.push((chain.to_owned(), rest.to_owned()));
                }
            }
        }
    }
    if let Some((name, table)) = current {
        tables.insert(name, table);
    }
    tables
}

/// The chain a rule jumps or goes to, if any.
pub fn rule_target(rule: &str) -> Option<String> {
    let words = split_words(rule);
    words
        .windows(2)
        .find(|pair| pair[0] == "-j" || pair[0] == "-g" || pair[0] == "--jump" || pair[0] == "--goto")
        .map(|pair| pair[1].clone())
}

/// Splits a rule into words as iptables-restore does: whitespace separates, double quotes
/// group.
pub fn split_words(rule: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut in_word = false;
    for c in rule.chars() {
        match c {
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    words.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        words.push(word);
    }
    words
}

/// One table's part of a restore transaction.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TablePlan {
    /// Chains written whole: declared (created or flushed), then their rules.
    pub write: Vec<(String, Vec<String>)>,
    /// Chains flushed and deleted.
    pub delete: Vec<String>,
    /// Rules deleted from chains that stay (`-D chain rule`).
    pub delete_rules: Vec<(String, String)>,
    /// Jumps from built-in chains inserted at the top, in this order.
    pub insert: Vec<Jump>,
    /// Shared chains created because they do not exist (declared, never flushed).
    pub create: Vec<String>,
    /// Rules appended to chains that are not ours alone (`-A chain rule`), because missing.
    pub append: Vec<(String, String)>,
}

impl TablePlan {
    pub fn is_empty(&self) -> bool {
        self.write.is_empty()
            && self.delete.is_empty()
            && self.delete_rules.is_empty()
            && self.insert.is_empty()
            && self.create.is_empty()
            && self.append.is_empty()
    }
}

/// A whole transaction for one family.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    pub tables: BTreeMap<TableName, TablePlan>,
}

impl Plan {
    pub fn is_empty(&self) -> bool {
        self.tables.values().all(TablePlan::is_empty)
    }

    /// Names of the chains written, per table.
    pub fn written(&self) -> Vec<(TableName, &str)> {
        self.tables
            .iter()
            .flat_map(|(table, plan)| plan.write.iter().map(move |(chain, _)| (*table, chain.as_str())))
            .collect()
    }

    /// Names of the chains deleted, per table.
    pub fn deleted(&self) -> Vec<(TableName, &str)> {
        self.tables
            .iter()
            .flat_map(|(table, plan)| plan.delete.iter().map(move |chain| (*table, chain.as_str())))
            .collect()
    }

    /// The `iptables-restore --noflush` input.
    pub fn render(&self) -> String {
        let mut text = String::new();
        for (table, plan) in &self.tables {
            if plan.is_empty() {
                continue;
            }
            let _ = writeln!(text, "*{}", table.as_str());
            for (chain, _) in &plan.write {
                let _ = writeln!(text, ":{chain} - [0:0]");
            }
            for chain in plan.delete.iter().chain(&plan.create) {
                let _ = writeln!(text, ":{chain} - [0:0]");
            }
            for (chain, rules) in &plan.write {
                for rule in rules {
                    let _ = writeln!(text, "-A {chain} {rule}");
                }
            }
            for (chain, rule) in &plan.append {
                let _ = writeln!(text, "-A {chain} {rule}");
            }
            for (chain, rule) in &plan.delete_rules {
                let _ = writeln!(text, "-D {chain} {rule}");
            }
            for chain in &plan.delete {
                let _ = writeln!(text, "-X {chain}");
            }
            for jump in &plan.insert {
                let _ = writeln!(text, "-I {} 1 {}", jump.from, jump.rule());
            }
            text.push_str("COMMIT\n");
        }
        text
    }
}

/// After the first sync: only the chains whose rules differ from what the last successful
/// sync wrote, and the deletion of chains no longer wanted.
pub fn partial(previous: &Ruleset, wanted: &Ruleset) -> Plan {
    let mut plan = Plan::default();
    for table in TableName::ALL {
        let (before, after) = (previous.table(table), wanted.table(table));
        let entry = TablePlan {
            write: after
                .chains
                .iter()
                .filter(|(chain, rules)| before.chains.get(*chain) != Some(*rules))
                .map(|(chain, rules)| (chain.clone(), rules.clone()))
                .collect(),
            delete: before
                .chains
                .keys()
                .filter(|chain| !after.chains.contains_key(*chain))
                .cloned()
                .collect(),
            ..TablePlan::default()
        };
        plan.tables.insert(table, entry);
    }
    plan
}

/// Everything: every wanted chain, the deletion of service chains that exist but are not
/// wanted (vipr's or kube-proxy's), and the jumps from built-in chains that are missing.
/// With [`Ruleset::localnet_guard`], also kubelet's `KUBE-FIREWALL` (created only if missing,
/// never flushed), the guard rule in it if missing, and the jumps to it if missing, above the
/// others (kube-proxy ensures them after its own, each inserted at the top).
/// `saved` is `iptables-save` of the family (tables absent from it are taken as empty).
pub fn full(saved: &BTreeMap<String, SavedTable>, wanted: &Ruleset) -> Plan {
    let mut plan = Plan::default();
    let empty = SavedTable::default();
    for table in TableName::ALL {
        let existing = saved.get(table.as_str()).unwrap_or(&empty);
        let want = wanted.table(table);
        let write: Vec<(String, Vec<String>)> =
            want.chains.iter().map(|(chain, rules)| (chain.clone(), rules.clone())).collect();
        let candidates: BTreeSet<String> = existing
            .user_chains()
            .filter(|chain| is_service_chain(chain) && !want.chains.contains_key(*chain))
            .map(str::to_owned)
            .collect();
        let rewritten: BTreeSet<String> = want.chains.keys().cloned().collect();
        let delete = deletable(existing, candidates, &rewritten);
        let guard_jumps: &[Jump] = if wanted.localnet_guard { &LOCALNET_GUARD_JUMPS } else { &[] };
        let insert = JUMPS
            .iter()
            .chain(guard_jumps)
            .filter(|jump| jump.table == table)
            .filter(|jump| {
                !existing
                    .rules
                    .iter()
                    .any(|(chain, rule)| chain == jump.from && rule_target(rule).as_deref() == Some(jump.to))
            })
            .copied()
            .collect();
        let mut create = Vec::new();
        let mut append = Vec::new();
        if wanted.localnet_guard && table == TableName::Filter {
            if !existing.chains.contains_key(KUBE_FIREWALL) {
                create.push(KUBE_FIREWALL.to_owned());
            }
            if !existing.rules.iter().any(|(chain, rule)| chain == KUBE_FIREWALL && is_localnet_guard(rule)) {
                append.push((KUBE_FIREWALL.to_owned(), LOCALNET_GUARD.to_owned()));
            }
        }
        plan.tables.insert(
            table,
            TablePlan {
                write,
                delete: delete.into_iter().collect(),
                delete_rules: Vec::new(),
                insert,
                create,
                append,
            },
        );
    }
    plan
}

/// Whether a saved rule is the CVE-2020-8558 guard ([`LOCALNET_GUARD`], kube-proxy's and
/// kubelet's), whatever order `iptables-save` prints its matches in.
pub fn is_localnet_guard(rule: &str) -> bool {
    let words = split_words(rule);
    let has = |sequence: &[&str]| words.windows(sequence.len()).any(|window| window == sequence);
    has(&["-d", "127.0.0.0/8"])
        && has(&["!", "-s", "127.0.0.0/8"])
        && has(&["!", "--ctstate", "RELATED,ESTABLISHED,DNAT"])
        && rule_target(rule).as_deref() == Some("DROP")
}

/// The chains of `candidates` that can be deleted in a transaction that rewrites `rewritten`:
/// those no surviving rule refers to. A chain referred to from a chain that stays as it is
/// (someone else's) is kept, and so are the chains it refers to.
fn deletable(
    existing: &SavedTable,
    mut candidates: BTreeSet<String>,
    rewritten: &BTreeSet<String>,
) -> BTreeSet<String> {
    loop {
        let kept: Vec<String> = existing
            .rules
            .iter()
            .filter(|(chain, _)| !candidates.contains(chain) && !rewritten.contains(chain))
            .filter_map(|(_, rule)| rule_target(rule))
            .filter(|target| candidates.contains(target))
            .collect();
        if kept.is_empty() {
            return candidates;
        }
        for chain in kept {
            candidates.remove(&chain);
        }
    }
}

/// `--cleanup` of one family: every chain vipr or kube-proxy's iptables mode creates (the
/// top-level ones, the per-service ones, kube-proxy's canary), and the rules of built-in
/// chains that jump to them. Chains and rules of anyone else stay; a chain of ours that
/// someone else's rule refers to stays too.
pub fn cleanup(saved: &BTreeMap<String, SavedTable>) -> BTreeMap<String, TablePlan> {
    let mut plans = BTreeMap::new();
    for (name, existing) in saved {
        let top_level: &[&str] = match name.as_str() {
            "filter" => TableName::Filter.top_level(),
            "nat" => TableName::Nat.top_level(),
            _ => &[],
        };
        let candidates: BTreeSet<String> = existing
            .user_chains()
            .filter(|chain| {
                is_service_chain(chain) || top_level.contains(chain) || *chain == KUBE_PROXY_CANARY
            })
            .map(str::to_owned)
            .collect();
        // Jumps from built-in chains go with the chains they lead to.
        let delete_rules: Vec<(String, String)> = existing
            .rules
            .iter()
            .filter(|(chain, rule)| {
                existing.is_builtin(chain)
                    && rule_target(rule).is_some_and(|target| candidates.contains(&target))
            })
            .cloned()
            .collect();
        let mut remaining = existing.clone();
        remaining.rules.retain(|rule| !delete_rules.contains(rule));
        let delete = deletable(&remaining, candidates, &BTreeSet::new());
        let plan = TablePlan { delete: delete.into_iter().collect(), delete_rules, ..TablePlan::default() };
        if !plan.is_empty() {
            plans.insert(name.clone(), plan);
        }
    }
    plans
}

/// The restore input of a cleanup (tables by name, as `iptables-save` names them).
pub fn render_cleanup(plans: &BTreeMap<String, TablePlan>) -> String {
    let mut text = String::new();
    for (table, plan) in plans {
        let _ = writeln!(text, "*{table}");
        for chain in &plan.delete {
            let _ = writeln!(text, ":{chain} - [0:0]");
        }
        for (chain, rule) in &plan.delete_rules {
            let _ = writeln!(text, "-D {chain} {rule}");
        }
        for chain in &plan.delete {
            let _ = writeln!(text, "-X {chain}");
        }
        text.push_str("COMMIT\n");
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataplane::iptables::ruleset::Table;

    const SAVED: &str = r#"# Generated by iptables-save v1.8.9 (nf_tables) on Sat Nov 21 14:38:52 2026
*nat
:PREROUTING ACCEPT [0:0]
:INPUT ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:POSTROUTING ACCEPT [0:0]
:KUBE-SERVICES - [0:0]
:KUBE-SVC-OLD0000000000000 - [0:0]
:KUBE-SEP-OLD0000000000000 - [0:0]
:KUBE-SVC-PINNED0000000000 - [0:0]
:CNI-FOO - [0:0]
-A PREROUTING -m comment --comment "kubernetes service portals" -j KUBE-SERVICES
-A POSTROUTING -s 10.0.0.0/8 -j CNI-FOO
-A KUBE-SERVICES -d 172.30.0.41/32 -p tcp -m comment --comment "ns1/svc1:p80 cluster IP" -m tcp --dport 80 -j KUBE-SVC-OLD0000000000000
-A KUBE-SVC-OLD0000000000000 -j KUBE-SEP-OLD0000000000000
-A KUBE-SEP-OLD0000000000000 -p tcp -m tcp -j DNAT --to-destination 10.180.0.1:80
-A CNI-FOO -j KUBE-SVC-PINNED0000000000
COMMIT
*filter
:INPUT ACCEPT [0:0]
:FORWARD DROP [0:0]
:OUTPUT ACCEPT [0:0]
:KUBE-FORWARD - [0:0]
:KUBE-FIREWALL - [0:0]
-A FORWARD -m comment --comment "kubernetes forwarding rules" -j KUBE-FORWARD
-A INPUT -j KUBE-FIREWALL
COMMIT
"#;

    fn ruleset(nat: &[(&str, &[&str])]) -> Ruleset {
        let table = |chains: &[(&str, &[&str])]| Table {
            chains: chains
                .iter()
                .map(|(name, rules)| {
                    ((*name).to_owned(), rules.iter().map(|rule| (*rule).to_owned()).collect())
                })
                .collect(),
        };
        Ruleset { filter: table(&[("KUBE-FORWARD", &["-j ACCEPT"])]), nat: table(nat), localnet_guard: false }
    }

    #[test]
    fn save_output_is_read_with_builtins_rules_and_targets() {
        let saved = parse_save(SAVED);
        let nat = &saved["nat"];
        assert_eq!(nat.chains.get("PREROUTING"), Some(&true));
        assert_eq!(nat.chains.get("KUBE-SERVICES"), Some(&false));
        assert_eq!(nat.rules.len(), 6);
        assert_eq!(rule_target(&nat.rules[0].1).as_deref(), Some("KUBE-SERVICES"));
        assert_eq!(rule_target("-m comment --comment \"-j NOT-THIS\" -j THIS").as_deref(), Some("THIS"));
        assert_eq!(rule_target("-m mark --mark 0x4000/0x4000"), None);
        assert_eq!(saved["filter"].chains.get("FORWARD"), Some(&true));
    }

    #[test]
    fn a_full_sync_writes_everything_deletes_stale_chains_and_adds_missing_jumps() {
        let saved = parse_save(SAVED);
        let wanted = ruleset(&[
            ("KUBE-SERVICES", &["-j KUBE-SVC-NEW0000000000000"]),
            ("KUBE-SVC-NEW0000000000000", &[]),
        ]);
        let plan = full(&saved, &wanted);
        let nat = &plan.tables[&TableName::Nat];
        assert_eq!(nat.write.len(), 2);
        // KUBE-SVC-PINNED is referred to by someone else's chain: it stays.
        assert_eq!(nat.delete, ["KUBE-SEP-OLD0000000000000", "KUBE-SVC-OLD0000000000000"]);
        // PREROUTING already jumps to KUBE-SERVICES.
        let inserted: Vec<(&str, &str)> = nat.insert.iter().map(|jump| (jump.from, jump.to)).collect();
        assert_eq!(inserted, [("OUTPUT", "KUBE-SERVICES"), ("POSTROUTING", "KUBE-POSTROUTING")]);
        let filter = &plan.tables[&TableName::Filter];
        assert!(!filter.insert.iter().any(|jump| jump.to == "KUBE-FORWARD"), "FORWARD jumps there already");
        assert_eq!(filter.insert.len(), 8);

        let text = plan.render();
        let nat_text = &text[text.find("*nat").unwrap()..];
        let position =
            |line: &str| nat_text.find(line).unwrap_or_else(|| panic!("{line:?} missing in\n{nat_text}"));
        // Chains are declared before anything refers to them, deleted after the rules that
        // referred to them were replaced, and jumps come last.
        assert!(
            position(":KUBE-SVC-OLD0000000000000 - [0:0]") < position("-A KUBE-SERVICES -j KUBE-SVC-NEW")
        );
        assert!(position("-A KUBE-SERVICES") < position("-X KUBE-SVC-OLD0000000000000"));
        assert!(
            position("-X KUBE-SEP-OLD")
                < position(
                    "-I OUTPUT 1 -m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES"
                )
        );
        assert!(text.starts_with("*filter\n") && text.ends_with("COMMIT\n"));
    }

    #[test]
    fn a_partial_sync_writes_only_changed_chains_and_deletes_unwanted_ones() {
        let before = ruleset(&[
            ("KUBE-SERVICES", &["-j KUBE-SVC-A", "-j KUBE-SVC-B"]),
            ("KUBE-SVC-A", &["-j KUBE-SEP-A"]),
            ("KUBE-SVC-B", &["-j KUBE-SEP-B"]),
        ]);
        let after = ruleset(&[("KUBE-SERVICES", &["-j KUBE-SVC-A"]), ("KUBE-SVC-A", &["-j KUBE-SEP-A2"])]);
        let plan = partial(&before, &after);
        assert_eq!(plan.written(), [(TableName::Nat, "KUBE-SERVICES"), (TableName::Nat, "KUBE-SVC-A")]);
        assert_eq!(plan.deleted(), [(TableName::Nat, "KUBE-SVC-B")]);
        assert!(plan.tables[&TableName::Filter].is_empty());
        assert!(!plan.render().contains("*filter"), "an unchanged table is left out");
        assert!(partial(&after, &after).is_empty());
    }

    #[test]
    fn cleanup_removes_ours_and_kube_proxys_and_keeps_the_rest() {
        let plans = cleanup(&parse_save(SAVED));
        let nat = &plans["nat"];
        assert_eq!(nat.delete, ["KUBE-SEP-OLD0000000000000", "KUBE-SERVICES", "KUBE-SVC-OLD0000000000000"]);
        assert_eq!(
            nat.delete_rules,
            [(
                "PREROUTING".to_owned(),
                "-m comment --comment \"kubernetes service portals\" -j KUBE-SERVICES".to_owned()
            )]
        );
        let filter = &plans["filter"];
        assert_eq!(filter.delete, ["KUBE-FORWARD"]);
        assert_eq!(filter.delete_rules.len(), 1, "kubelet's KUBE-FIREWALL jump stays");
        let text = render_cleanup(&plans);
        assert!(!text.contains("CNI-FOO") && !text.contains("KUBE-FIREWALL") && !text.contains("PINNED"));
    }

    /// With localhost NodePorts: kubelet's KUBE-FIREWALL is created only where missing (a
    /// declaration would flush it), the guard appended only where missing, and the jumps to it
    /// inserted only where missing, after (so above) the others.
    #[test]
    fn a_full_sync_ensures_the_localnet_guard_without_flushing_kube_firewall() {
        let mut wanted = ruleset(&[("KUBE-SERVICES", &[])]);
        wanted.localnet_guard = true;
        // SAVED has KUBE-FIREWALL and INPUT's jump to it, but not the guard.
        let plan = full(&parse_save(SAVED), &wanted);
        let filter = &plan.tables[&TableName::Filter];
        assert!(filter.create.is_empty());
        assert_eq!(filter.append, [(KUBE_FIREWALL.to_owned(), LOCALNET_GUARD.to_owned())]);
        let inserted: Vec<&str> =
            filter.insert.iter().filter(|jump| jump.to == KUBE_FIREWALL).map(|jump| jump.from).collect();
        assert_eq!(inserted, ["OUTPUT"]);
        assert_eq!(filter.insert.last().unwrap().to, KUBE_FIREWALL, "inserted last: on top");
        let text = plan.render();
        assert!(!text.contains(":KUBE-FIREWALL"), "never flushed:\n{text}");
        assert!(text.contains(&format!("-A KUBE-FIREWALL {LOCALNET_GUARD}\n")));
        assert!(text.contains("-I OUTPUT 1 -j KUBE-FIREWALL\n"));

        // Nothing there: created. Everything there (as iptables-save prints kubelet's rule):
        // nothing to do.
        let bare = parse_save("*filter\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\nCOMMIT\n");
        let filter = &full(&bare, &wanted).tables[&TableName::Filter];
        assert_eq!(filter.create, [KUBE_FIREWALL]);
        assert_eq!(filter.append.len(), 1);
        let kubelet = parse_save(
            "*filter\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n:KUBE-FIREWALL - [0:0]\n\
             -A INPUT -j KUBE-FIREWALL\n-A OUTPUT -j KUBE-FIREWALL\n\
             -A KUBE-FIREWALL ! -s 127.0.0.0/8 -d 127.0.0.0/8 -m comment --comment \"block incoming localnet \
             connections\" -m conntrack ! --ctstate RELATED,ESTABLISHED,DNAT -j DROP\nCOMMIT\n",
        );
        let filter = &full(&kubelet, &wanted).tables[&TableName::Filter];
        assert!(filter.create.is_empty() && filter.append.is_empty());
        assert!(!filter.insert.iter().any(|jump| jump.to == KUBE_FIREWALL));
        // Without the flag KUBE-FIREWALL is not touched; cleanup never touches it.
        wanted.localnet_guard = false;
        let filter = &full(&bare, &wanted).tables[&TableName::Filter];
        assert!(filter.create.is_empty() && filter.append.is_empty());
        assert!(!filter.insert.iter().any(|jump| jump.to == KUBE_FIREWALL));
        assert!(!render_cleanup(&cleanup(&kubelet)).contains("KUBE-FIREWALL"));
    }
}
