//! The seed table end to end at a small shape on the CPU: every scenario's
//! values and gradients against the f64 reference, and the offload row's
//! saved values in host memory (issue 20).

use tessera::ir::DType;
use tessera_apps::seed_table::{run, SeedConfig, SCENARIOS};

#[test]
fn every_scenario_matches_the_f64_reference_and_offload_moves_to_host() {
    let config = SeedConfig {
        shape: [2, 2, 64, 16],
        dtype: DType::F32,
        reps: 1,
        ..SeedConfig::default()
    };
    let rows = run(&config, |_, _| {}).expect("the seed table runs");
    assert_eq!(rows.len(), SCENARIOS.len());
    for row in &rows {
        assert!(
            row.max_abs_err < 1e-4,
            "{}: max |err| {} against f64",
            row.scenario,
            row.max_abs_err
        );
    }
    let row = |name: &str| {
        rows.iter()
            .find(|r| r.scenario == name)
            .unwrap_or_else(|| panic!("no row {name}"))
    };
    let offloaded = row("hinted sliced graph + offload (compiled)");
    assert!(
        offloaded.host_mb > 0.0,
        "the offload row keeps nothing in host memory: {offloaded:?}"
    );
    for r in rows.iter().filter(|r| r.scenario != offloaded.scenario) {
        assert_eq!(r.host_mb, 0.0, "{} offloads: {r:?}", r.scenario);
    }
    let unhinted = row("sliced graph (compiled)");
    assert!(
        offloaded.working_mb < unhinted.working_mb,
        "offloading does not lower the working memory: {offloaded:?} vs {unhinted:?}"
    );
}
