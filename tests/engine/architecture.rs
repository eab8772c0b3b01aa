//! The structure the design promises, checked on the source: the core (the limiter, the
//! store, the algorithms and the rest outside the tiers) names no tier, and no two files
//! of `src` import each other.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The tiers: each behind its own cargo feature, on top of the core.
const TIERS: [&str; 3] = ["sync", "redis", "http"];

/// Every `.rs` file under `src`, by its module path (`["sync", "task"]`; `lib.rs` and a
/// `mod.rs` are their folder's module).
fn modules() -> BTreeMap<Vec<String>, PathBuf> {
    fn walk(dir: &Path, into: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, into);
            } else if path.extension().is_some_and(|e| e == "rs") {
                into.push(path);
            }
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    walk(&src, &mut files);
    files
        .into_iter()
        .map(|path| {
            let rel = path.strip_prefix(&src).unwrap().with_extension("");
            let mut module: Vec<String> = rel
                .iter()
                .map(|part| part.to_string_lossy().into_owned())
                .collect();
            if matches!(module.last().map(String::as_str), Some("mod" | "lib")) {
                module.pop();
            }
            (module, path)
        })
        .collect()
}

/// The source without comments and without its `#[cfg(test)] mod tests`.
fn code(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap();
    let text = text.split("#[cfg(test)]\nmod tests").next().unwrap();
    text.lines()
        .map(|line| line.split("//").next().unwrap())
        .collect::<Vec<_>>()
        .join("\n")
}

/// The module paths `code` names, from `crate::` and `super::` paths, grouped ones
/// included (`use super::{a, b::c}`), resolved against `module`.
fn references(module: &[String], code: &str) -> Vec<Vec<String>> {
    let parent = module[..module.len().saturating_sub(1)].to_vec();
    let mut found = Vec::new();
    for (root, base) in [("crate::", Vec::new()), ("super::", parent)] {
        for (at, _) in code.match_indices(root) {
            // Not `foo_crate::` or `self::super::`-like tails of other words.
            if code[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
                continue;
            }
            let rest = &code[at + root.len()..];
            let prefixes: Vec<String> = if let Some(group) = rest.strip_prefix('{') {
                let inner = &group[..group.find('}').unwrap_or(group.len())];
                inner.split(',').map(|s| s.trim().to_owned()).collect()
            } else {
                vec![rest.to_owned()]
            };
            for item in prefixes {
                let path: Vec<String> = item
                    .split("::")
                    .map(|seg| {
                        seg.chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect::<String>()
                    })
                    .take_while(|seg| !seg.is_empty())
                    .collect();
                let mut full = base.clone();
                full.extend(path);
                found.push(full);
            }
        }
    }
    found
}

/// The longest prefix of `path` that is a module of `src`.
fn resolve(modules: &BTreeMap<Vec<String>, PathBuf>, path: &[String]) -> Option<Vec<String>> {
    (1..=path.len())
        .rev()
        .map(|n| path[..n].to_vec())
        .find(|prefix| modules.contains_key(prefix))
}

fn is_tier(module: &[String]) -> bool {
    module.first().is_some_and(|m| TIERS.contains(&m.as_str()))
}

/// Which modules each module imports (not counting its own submodules or ancestors,
/// which a `mod.rs` declares and re-exports).
fn imports() -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let modules = modules();
    modules
        .iter()
        .map(|(module, path)| {
            let deps = references(module, &code(path))
                .into_iter()
                .filter_map(|reference| resolve(&modules, &reference))
                .filter(|dep| !dep.starts_with(module) && !module.starts_with(dep))
                .collect();
            (module.clone(), deps)
        })
        .collect()
}

#[test]
fn the_core_names_no_tier() {
    let imports = imports();
    assert!(imports.len() > 40, "the walk found the source files");
    let mut offences = Vec::new();
    for (module, deps) in &imports {
        if is_tier(module) || module.is_empty() {
            continue; // lib.rs declares the tiers
        }
        for dep in deps.iter().filter(|d| is_tier(d)) {
            offences.push(format!("{} imports {}", module.join("/"), dep.join("/")));
        }
    }
    assert!(offences.is_empty(), "{offences:#?}");
}

#[test]
fn no_two_files_import_each_other() {
    let imports = imports();
    // The check finds an import at all: the synced limiter's task imports the limiter.
    assert!(
        imports[&vec!["sync".to_owned(), "task".to_owned()]]
            .contains(&vec!["sync".to_owned(), "limiter".to_owned()])
    );
    let mut cycles = Vec::new();
    for (a, deps) in &imports {
        for b in deps {
            if a < b && imports.get(b).is_some_and(|back| back.contains(a)) {
                cycles.push(format!("{} <-> {}", a.join("/"), b.join("/")));
            }
        }
    }
    assert!(cycles.is_empty(), "{cycles:#?}");
}
