//! Choosing an order: candidate orders are built by the list scheduler and
//! compared by their predicted peak (`Liveness`), for `auto`, for `auto`
//! regions, and under memory budgets (the compile option or a region's
//! `memory_budget_mb`).

use super::buffers::BufferModel;
use super::hinted::{Hints, KernelHint};
use super::kernels::KernelGraph;
use super::list::{self, Base};
use super::memory::Liveness;
use super::streams;
use super::{Donations, Schedule, ScheduleOptions, Strategy};
use crate::error::Result;
use crate::fusion::Plan;
use crate::ir::Graph;
use crate::logging::log;
use crate::runtime::device::Device;

/// `auto` takes the most parallel order whose predicted peak is at most
/// the lowest plus 1/`AUTO_SLACK` of it: parallel steps are worth a little
/// memory, not a multiple of it.
const AUTO_SLACK: usize = 3;

pub(crate) struct Context {
    pub kg: KernelGraph,
    pub hints: Hints,
    pub model: BufferModel,
}

/// One candidate order and what it costs.
struct Candidate {
    name: String,
    steps: Vec<Vec<usize>>,
    notes: Vec<String>,
    live: Liveness,
    fits: bool,
}

impl Candidate {
    fn peak(&self) -> usize {
        self.live.peak()
    }
}

impl Context {
    /// `donated`: the graph inputs the caller hands over.
    pub fn new(graph: &Graph, plan: &Plan, on: Device, donated: &Donations) -> Result<Context> {
        let kg = KernelGraph::new(graph, plan);
        let hints = Hints::read(graph, plan, &kg);
        let mut model = BufferModel::new(graph, plan, &kg, on, donated)?;
        model.stream_of = streams::kernel_streams(&hints);
        Ok(Context { kg, hints, model })
    }

    pub fn choose(&self, options: &ScheduleOptions) -> Schedule {
        let mut warnings = Vec::new();
        let mut notes = self.hints.notes.clone();
        let region_order = self.resolve_regions(options, &mut notes, &mut warnings);
        let (mut best, name) = self.requested(options, &region_order);
        let mut chosen = name;
        if let Some(budget) = options.memory_budget {
            (best, chosen) = self.within_budget(best, chosen, budget, &region_order, &mut warnings);
        }
        // Coarsening merges steps, which sorts a moved reader of another
        // stream's value back among the kernels it was moved after.
        let deferred =
            streams::defer_cross_stream_readers(best.steps.clone(), &self.kg, &self.hints);
        if deferred != best.steps {
            best.live = Liveness::new(&self.model, &deferred);
            best.steps = deferred;
        }
        self.check_region_budgets(&best, &mut warnings);
        for w in &warnings {
            eprintln!("tessera: warning: {w}");
        }
        for line in notes.iter().chain(&best.notes).chain(&warnings) {
            log("schedule", || line.clone());
        }
        notes.extend(best.notes);
        Schedule {
            steps: best.steps,
            chosen,
            notes,
            warnings,
            streams: None,
        }
    }

    fn candidate(
        &self,
        region_order: &[Option<Strategy>],
        base: Base,
        budget: Option<usize>,
    ) -> Candidate {
        let inputs = list::Inputs {
            kg: &self.kg,
            hints: &self.hints,
            model: &self.model,
            region_order,
        };
        let (steps, notes) = list::schedule(&inputs, base);
        let steps = streams::defer_cross_stream_readers(steps, &self.kg, &self.hints);
        let live = Liveness::new(&self.model, &steps);
        let fits = self.fits(&steps, &live, budget);
        Candidate {
            name: base.name().to_string(),
            steps,
            notes,
            live,
            fits,
        }
    }

    /// Whether every step stays within the budget and the budgets of the
    /// regions whose kernels it runs.
    fn fits(&self, steps: &[Vec<usize>], live: &Liveness, budget: Option<usize>) -> bool {
        steps
            .iter()
            .zip(&live.step_bytes)
            .all(|(step, &bytes)| self.step_budget(step, budget).is_none_or(|b| bytes <= b))
    }

    fn step_budget(&self, step: &[usize], budget: Option<usize>) -> Option<usize> {
        step.iter()
            .filter_map(|&k| self.hints.kernels[k].budget)
            .chain(budget)
            .min()
    }

    /// The base a strategy gives the kernels without an order hint.
    fn base_of(strategy: Strategy) -> Base {
        match strategy {
            Strategy::Bfs | Strategy::Auto => Base::Bfs,
            Strategy::Dfs => Base::Dfs,
            Strategy::Strict => Base::Strict,
        }
    }

    /// The order the options ask for; `auto`: the most parallel of all
    /// bases whose predicted peak is within [`AUTO_SLACK`] of the lowest,
    /// coarsened within that bound — level order wherever it is about as
    /// low, a sequential order only where that saves much.
    fn requested(
        &self,
        options: &ScheduleOptions,
        region_order: &[Option<Strategy>],
    ) -> (Candidate, String) {
        if options.strategy != Strategy::Auto {
            let c = self.candidate(
                region_order,
                Self::base_of(options.strategy),
                options.memory_budget,
            );
            let name = c.name.clone();
            return (c, name);
        }
        let all: Vec<Candidate> = [Base::Bfs, Base::Dfs, Base::Strict, Base::Greedy]
            .into_iter()
            .map(|b| self.candidate(region_order, b, options.memory_budget))
            .collect();
        let peaks = peaks_of(&all);
        let low = all.iter().map(Candidate::peak).min().unwrap_or(0);
        let bound = low.saturating_add(low / AUTO_SLACK);
        let mut best = all
            .into_iter()
            .filter(|c| c.peak() <= bound)
            .map(|c| self.coarsened(c, bound, region_order))
            .min_by_key(|c| (c.steps.len(), c.peak()))
            .expect("the lowest is within the bound");
        // Coarsening checked the bound; a memory budget is checked next.
        best.fits = self.fits(&best.steps, &best.live, options.memory_budget);
        let name = format!("auto: {} (peaks: {peaks})", best.name);
        (best, name)
    }

    /// The requested order if it fits; else the most parallel candidate
    /// that fits (fewest steps, then lowest peak); else the lowest peak,
    /// with a warning.
    fn within_budget(
        &self,
        requested: Candidate,
        name: String,
        budget: usize,
        region_order: &[Option<Strategy>],
        warnings: &mut Vec<String>,
    ) -> (Candidate, String) {
        if requested.fits {
            return (
                requested,
                format!("{name} (fits the budget of {budget} bytes)"),
            );
        }
        let all: Vec<Candidate> = [Base::Bfs, Base::Greedy, Base::Dfs, Base::Strict]
            .into_iter()
            .map(|b| self.candidate(region_order, b, Some(budget)))
            .collect();
        let peaks = peaks_of(&all);
        let (fitting, rest): (Vec<Candidate>, Vec<Candidate>) =
            all.into_iter().partition(|c| c.fits);
        if fitting.is_empty() {
            let best = lowest(rest);
            warnings.push(format!(
                "no order fits the memory budget of {budget} bytes (peaks: {peaks}); running the lowest, {} ({} bytes)",
                best.name,
                best.peak()
            ));
            let name = format!("budget: {} (over budget)", best.name);
            return (best, name);
        }
        let best = fitting
            .into_iter()
            .map(|c| self.coarsened(c, budget, region_order))
            .min_by_key(|c| (c.steps.len(), c.peak()))
            .expect("one fits");
        let name = format!(
            "budget: {} in {} steps (peaks: {peaks})",
            best.name,
            best.steps.len()
        );
        (best, name)
    }

    /// `c` with consecutive independent steps merged into one while the
    /// merged step stays within the budget: the most parallelism the budget
    /// allows along `c`'s order.
    fn coarsened(
        &self,
        c: Candidate,
        budget: usize,
        region_order: &[Option<Strategy>],
    ) -> Candidate {
        let merged = self.merged_steps(&c, budget, region_order);
        let name = if merged.len() < c.steps.len() {
            format!("{}, coarsened", c.name)
        } else {
            c.name
        };
        let live = Liveness::new(&self.model, &merged);
        let fits = self.fits(&merged, &live, Some(budget));
        debug_assert!(fits, "coarsening keeps every step within the budget");
        Candidate {
            name,
            steps: merged,
            notes: c.notes,
            live,
            fits,
        }
    }

    /// `c`'s steps, each merged into the one before while they may share a
    /// step and the merged step stays within the budget. A merged step
    /// holds what was live at its start and all it creates (in-place reuse
    /// not counted): an upper bound, so the result fits.
    fn merged_steps(
        &self,
        c: &Candidate,
        budget: usize,
        region_order: &[Option<Strategy>],
    ) -> Vec<Vec<usize>> {
        let created = |step: &[usize]| -> usize {
            step.iter()
                .flat_map(|&k| &self.model.created[k])
                .map(|&b| self.model.buffers[b].bytes)
                .sum()
        };
        let mut merged: Vec<Vec<usize>> = Vec::new();
        let mut bytes = 0;
        for (t, step) in c.steps.iter().enumerate() {
            let grown = bytes + created(step);
            let joins = merged.last().is_some_and(|m| {
                let all: Vec<usize> = m.iter().chain(step).copied().collect();
                self.may_share_a_step(m, step, region_order)
                    && self
                        .step_budget(&all, Some(budget))
                        .is_none_or(|b| grown <= b)
            });
            if joins {
                merged.last_mut().expect("checked").extend(step);
                bytes = grown;
            } else {
                merged.push(step.clone());
                bytes = c.live.start_bytes[t] + created(step);
            }
        }
        for step in &mut merged {
            step.sort_unstable();
        }
        merged
    }

    /// Whether `next` may run concurrently with `step`: independent, no two
    /// kernels of one chained region, no group mixed with anything else.
    fn may_share_a_step(
        &self,
        step: &[usize],
        next: &[usize],
        region_order: &[Option<Strategy>],
    ) -> bool {
        let hint = |k: usize| &self.hints.kernels[k];
        let independent = next
            .iter()
            .all(|&k| self.kg.producers[k].iter().all(|p| !step.contains(p)));
        let chained = |k: usize| {
            hint(k)
                .region
                .is_some_and(|r| matches!(region_order[r], Some(Strategy::Strict | Strategy::Dfs)))
        };
        let one_per_chain = next
            .iter()
            .all(|&k| !chained(k) || step.iter().all(|&j| hint(j).region != hint(k).region));
        let group = hint(step[0]).group;
        let same_group = step.iter().chain(next).all(|&k| hint(k).group == group);
        let within_width = next.iter().all(|&k| {
            let (Some(r), Some(width)) = (hint(k).region, hint(k).max_width) else {
                return true;
            };
            let in_region = |j: &&usize| hint(**j).region == Some(r);
            step.iter().filter(in_region).count() + next.iter().filter(in_region).count() <= width
        });
        independent && one_per_chain && same_group && within_width
    }

    /// Each region's order: its hint; `auto`: the lowest peak of bfs, dfs
    /// and strict for it; a budget without an order: the most parallel of
    /// those that fits; a group without an order: strict.
    fn resolve_regions(
        &self,
        options: &ScheduleOptions,
        notes: &mut Vec<String>,
        warnings: &mut Vec<String>,
    ) -> Vec<Option<Strategy>> {
        let hints: Vec<KernelHint> = (0..self.hints.regions.len())
            .map(|r| {
                let first = self.hints.kernels.iter().find(|h| h.region == Some(r));
                first.expect("a region has kernels").clone()
            })
            .collect();
        let mut order: Vec<Option<Strategy>> = hints
            .iter()
            .map(|h| match h.order {
                Some(Strategy::Auto) => Some(Strategy::Bfs),
                None if h.group.is_some() => Some(Strategy::Strict),
                o => o,
            })
            .collect();
        for (r, h) in hints.iter().enumerate() {
            let auto = h.order == Some(Strategy::Auto);
            if auto || (h.order.is_none() && h.budget.is_some()) {
                order[r] = Some(self.search_region(r, auto, &mut order, options, notes, warnings));
            }
        }
        order
    }

    /// Region `r`'s order among bfs, dfs and strict (the others as in
    /// `order`): the lowest peak (`auto`), or the first that fits the
    /// region's budget, else the lowest peak with a warning.
    fn search_region(
        &self,
        r: usize,
        auto: bool,
        order: &mut [Option<Strategy>],
        options: &ScheduleOptions,
        notes: &mut Vec<String>,
        warnings: &mut Vec<String>,
    ) -> Strategy {
        let base = Self::base_of(options.strategy);
        let tried: Vec<(Strategy, Candidate)> = [Strategy::Bfs, Strategy::Dfs, Strategy::Strict]
            .into_iter()
            .map(|o| {
                order[r] = Some(o);
                (o, self.candidate(order, base, options.memory_budget))
            })
            .collect();
        let region = &self.hints.regions[r];
        let peaks: Vec<String> = tried
            .iter()
            .map(|(o, c)| format!("{o} {}", c.peak()))
            .collect();
        let peaks = peaks.join(", ");
        let lowest = tried
            .iter()
            .min_by_key(|(_, c)| c.peak())
            .expect("three tried");
        let fitting = tried.iter().find(|(_, c)| c.fits);
        let pick = match (auto, fitting) {
            (true, _) => lowest.0,
            (false, Some((o, _))) => *o,
            (false, None) => {
                warnings.push(format!(
                    "hints {region}: no order of the region fits its memory budget (peaks: {peaks}); using {} ({} bytes)",
                    lowest.0,
                    lowest.1.peak()
                ));
                lowest.0
            }
        };
        notes.push(format!(
            "hints {region}: order {pick} chosen (peaks: {peaks})"
        ));
        pick
    }

    /// The first region whose budget the chosen order exceeds is warned
    /// about (unless choosing its order already warned).
    fn check_region_budgets(&self, best: &Candidate, warnings: &mut Vec<String>) {
        let over = best
            .steps
            .iter()
            .zip(&best.live.step_bytes)
            .find_map(|(step, &bytes)| {
                step.iter()
                    .filter_map(|&k| Some((k, self.hints.kernels[k].budget?)))
                    .find(|&(_, budget)| bytes > budget)
                    .map(|(k, budget)| (k, budget, bytes))
            });
        let Some((k, budget, bytes)) = over else {
            return;
        };
        let region = self.hints.kernels[k]
            .region
            .map_or("?", |r| &self.hints.regions[r]);
        if !warnings.iter().any(|w| w.contains(region)) {
            warnings.push(format!(
                "hints {region}: memory budget of {budget} bytes exceeded ({bytes} bytes predicted while kernel k{k} runs)"
            ));
        }
    }
}

fn peaks_of(all: &[Candidate]) -> String {
    all.iter()
        .map(|c| format!("{} {}", c.name, c.peak()))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The lowest peak; ties go to the earlier (more parallel) candidate.
fn lowest(all: Vec<Candidate>) -> Candidate {
    let mut best: Option<Candidate> = None;
    for c in all {
        if best.as_ref().is_none_or(|b| c.peak() < b.peak()) {
            best = Some(c);
        }
    }
    best.expect("at least one candidate")
}
