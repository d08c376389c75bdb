//! The rule that layers import one way, checked: within every crate of the workspace, no two
//! sibling modules reach each other through `crate::`, `super::` or `self::` paths, directly or
//! around a longer cycle. Test code (`#[cfg(test)] mod ...` blocks at the end of a file) and
//! comments are not counted: a test may reach anywhere.
//!
//! The scan reads paths, not Rust's name resolution: a module is a file (`a/b.rs` or
//! `a/b/mod.rs` is `a::b`), and a path names the longest module prefix it starts with. That is
//! enough for this code base, whose imports are written as paths from the crate root or a
//! parent.
use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
};

type Module = Vec<String>;

/// Each module's file, by module path.
fn modules(src: &Path) -> BTreeMap<Module, String> {
    let mut found = BTreeMap::new();
    let mut pending = vec![src.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let path = entry.path();
            if path.is_dir() {
                pending.push(path);
                continue;
            }
            let Ok(relative) = path.strip_prefix(src) else { continue };
            let Some(text) = relative.to_str().and_then(|relative| relative.strip_suffix(".rs")) else {
                continue;
            };
            let mut module: Module = text.split('/').map(str::to_owned).collect();
            if module.last().is_some_and(|last| last == "mod") {
                module.pop();
            }
            if matches!(module.as_slice(), [root] if root == "lib" || root == "main") || module.is_empty() {
                continue;
            }
            if module.first().is_some_and(|first| first == "bin") {
                // Binaries are crates of their own.
                continue;
            }
            if let Ok(source) = std::fs::read_to_string(&path) {
                found.insert(module, source);
            }
        }
    }
    found
}

/// The part of a file that counts: without comment lines and without the test module at its end.
fn counted(source: &str) -> String {
    let code = source.find("#[cfg(test)]\nmod ").map_or(source, |end| &source[..end]);
    code.lines().filter(|line| !line.trim_start().starts_with("//")).collect::<Vec<_>>().join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The paths a file names from `crate`, `super` or `self`, each as its segments resolved to
/// the crate root; `use a::{b, c::d}` names `a::b` and `a::c`.
fn paths(module: &Module, code: &str) -> Vec<Module> {
    let mut found = Vec::new();
    for base in ["crate::", "super::", "self::"] {
        let mut rest = code;
        while let Some(at) = rest.find(base) {
            let before = rest[..at].chars().next_back();
            rest = &rest[at + base.len()..];
            if before.is_some_and(is_ident) {
                continue;
            }
            let mut segments = Vec::new();
            let mut tail = rest;
            loop {
                let end = tail.find(|c: char| !is_ident(c)).unwrap_or(tail.len());
                if end == 0 {
                    break;
                }
                segments.push(tail[..end].to_owned());
                tail = &tail[end..];
                match tail.strip_prefix("::") {
                    Some(next) => tail = next,
                    None => break,
                }
            }
            let mut groups = vec![None];
            if let Some(group) = tail.strip_prefix('{') {
                let group = &group[..group.find('}').unwrap_or(group.len())];
                groups = group
                    .split(',')
                    .filter_map(|item| {
                        let first = item.trim().split("::").next()?.trim();
                        (!first.is_empty() && first.chars().all(is_ident)).then(|| Some(first.to_owned()))
                    })
                    .collect();
            }
            // `self::` starts at the module itself (`a` in a/mod.rs, `a::b` in a/b.rs),
            // `super::` at its parent.
            let start: Module = match base {
                "crate::" => Vec::new(),
                "self::" => module.clone(),
                _ => module[..module.len().saturating_sub(1)].to_vec(),
            };
            for group in groups {
                let mut path = start.clone();
                path.extend(segments.iter().cloned());
                path.extend(group);
                found.push(path);
            }
        }
    }
    found
}

/// Cycles among sibling modules: for each import from `a` to `b`, the edge between the
/// children of their deepest common parent that contain them.
fn sibling_cycles(src: &Path) -> Vec<Vec<String>> {
    let modules = modules(src);
    let mut edges: BTreeMap<Module, BTreeSet<Module>> = BTreeMap::new();
    for (module, source) in &modules {
        for path in paths(module, &counted(source)) {
            let Some(target) = (1..=path.len()).rev().map(|n| &path[..n]).find(|p| modules.contains_key(*p))
            else {
                continue;
            };
            let common = module.iter().zip(target).take_while(|(a, b)| a == b).count();
            if common < module.len() && common < target.len() {
                edges.entry(module[..=common].to_vec()).or_default().insert(target[..=common].to_vec());
            }
        }
    }
    strongly_connected(&edges)
        .into_iter()
        .filter(|component| component.len() > 1)
        .map(|component| component.into_iter().map(|module| module.join("::")).collect())
        .collect()
}

/// Tarjan's strongly connected components.
fn strongly_connected(edges: &BTreeMap<Module, BTreeSet<Module>>) -> Vec<Vec<Module>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<Module, BTreeSet<Module>>,
        index: BTreeMap<Module, usize>,
        low: BTreeMap<Module, usize>,
        stack: Vec<Module>,
        on_stack: BTreeSet<Module>,
        components: Vec<Vec<Module>>,
    }
    impl Walk<'_> {
        fn visit(&mut self, node: &Module) {
            let n = self.index.len();
            self.index.insert(node.clone(), n);
            self.low.insert(node.clone(), n);
            self.stack.push(node.clone());
            self.on_stack.insert(node.clone());
            for next in self.edges.get(node).into_iter().flatten() {
                if !self.index.contains_key(next) {
                    self.visit(next);
                    let low = self.low[node].min(self.low[next]);
                    self.low.insert(node.clone(), low);
                } else if self.on_stack.contains(next) {
                    let low = self.low[node].min(self.index[next]);
                    self.low.insert(node.clone(), low);
                }
            }
            if self.low[node] == self.index[node] {
                let mut component = Vec::new();
                while let Some(member) = self.stack.pop() {
                    self.on_stack.remove(&member);
                    let done = &member == node;
                    component.push(member);
                    if done {
                        break;
                    }
                }
                component.sort();
                self.components.push(component);
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        components: Vec::new(),
    };
    for node in edges.keys() {
        if !walk.index.contains_key(node) {
            walk.visit(node);
        }
    }
    walk.components
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_crate_has_an_import_cycle_between_its_modules() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut cycles = Vec::new();
        for krate in ["bench", "proxy-common", "proxy-ebpf", "proxy-userspace", "tests", "xtask"] {
            for cycle in sibling_cycles(&workspace.join(krate).join("src")) {
                cycles.push(format!("{krate}: {}", cycle.join(" <-> ")));
            }
        }
        assert!(cycles.is_empty(), "modules that import each other:\n{}", cycles.join("\n"));
    }

    #[test]
    fn a_cycle_through_a_use_group_is_found() {
        let src = std::env::temp_dir().join(format!("vipr-layers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(src.join("a")).unwrap();
        std::fs::write(src.join("lib.rs"), "mod a; mod b; mod c;").unwrap();
        std::fs::write(src.join("a/mod.rs"), "mod x;\nuse self::x::Thing;\n").unwrap();
        std::fs::write(src.join("a/x.rs"), "use crate::{b::B, c};\n").unwrap();
        std::fs::write(src.join("b.rs"), "// crate::c is only mentioned\nuse super::c::C;\n").unwrap();
        std::fs::write(src.join("c.rs"), "pub struct C;\n#[cfg(test)]\nmod tests { use crate::a::x; }\n")
            .unwrap();
        let acyclic = sibling_cycles(&src);
        std::fs::write(src.join("c.rs"), "use crate::a::x::Thing;\n").unwrap();
        let cyclic = sibling_cycles(&src);
        let _ = std::fs::remove_dir_all(&src);
        assert!(acyclic.is_empty(), "{acyclic:?}");
        assert_eq!(cyclic, vec![vec!["a".to_owned(), "b".to_owned(), "c".to_owned()]]);
    }
}
