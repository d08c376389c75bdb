//! The benchmark code keeps working: `vipr-bench datapath --quick` (what `cargo xtask bench
//! datapath --quick` runs) into a temporary directory, and its results look like
//! measurements. Needs root (BPF, namespaces), as the suite does.

use std::{path::Path, process::Command, time::Instant};

use serde_json::Value;

#[test]
fn quick_datapath_suite_measures_every_path() {
    let dir = std::env::temp_dir().join(format!("vipr-bench-quick-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_vipr-bench"))
        .args(["datapath", "--quick", "--out-dir"])
        .arg(&dir)
        .output()
        .expect("vipr-bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "vipr-bench failed ({}):\n{stderr}", output.status);
    eprintln!("quick datapath suite: {:.1} s", started.elapsed().as_secs_f64());

    let results: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("datapath.json")).expect("datapath.json written"),
    )
    .expect("datapath.json is JSON");
    for baseline in ["empty_repeat", "empty_single"] {
        let ns = results[baseline]["median"].as_f64().unwrap_or(f64::NAN);
        assert!(ns > 0.0 && ns < 10_000.0, "{baseline}: {ns} ns for an empty program");
    }
    let cells = results["cells"].as_array().expect("cells");
    assert!(cells.len() >= 2, "the quick grid has several cells");
    let paths = [
        "new-flow",
        "established",
        "reply",
        "miss",
        "new-flow-cold",
        "new-flow-masquerade-cold",
        "new-flow-spread-cold",
        "established-cold",
    ];
    for cell in cells {
        let name = format!("{} services x {} backends", cell["services"], cell["backends_per_service"]);
        let measured: Vec<&Value> = cell["paths"].as_array().expect("paths").iter().collect();
        for path in paths {
            let result = measured
                .iter()
                .find(|result| result["path"] == path)
                .unwrap_or_else(|| panic!("{name}: no {path} result"));
            let gross = result["measured"]["median"].as_f64().unwrap_or(f64::NAN);
            let program = result["program"]["median"].as_f64().unwrap_or(f64::NAN);
            // Sane: positive, below 100 µs a packet, and the program's own cost below what
            // the kernel measured (the empty program's cost was taken off).
            assert!(gross > 0.0 && gross < 100_000.0, "{name}, {path}: measured {gross} ns");
            assert!(
                program.is_finite() && program < gross,
                "{name}, {path}: program {program} ns of {gross}"
            );
        }
        let cost = |path: &str| {
            measured
                .iter()
                .find(|r| r["path"] == path)
                .and_then(|r| r["measured"]["median"].as_f64())
                .unwrap()
        };
        // A new flow does strictly more than a miss (service and backend lookups, two inserts).
        assert!(cost("new-flow") > cost("miss"), "{name}: a new flow cheaper than a miss?");
    }

    for file in ["datapath-services.png", "datapath-backends.png"] {
        let bytes = std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n") && bytes.len() > 10_000, "{file} is not a drawn PNG");
    }
    let doc = std::fs::read_to_string(dir.join("benchmarks.md")).expect("report written");
    for heading in ["## Targets", "## Datapath", "| new flow |", "datapath-services.png"] {
        assert!(doc.contains(heading), "the report lacks {heading:?}:\n{doc}");
    }
    remove(&dir);
}

fn remove(dir: &Path) {
    if let Err(error) = std::fs::remove_dir_all(dir) {
        eprintln!("cannot remove {}: {error}", dir.display());
    }
}
