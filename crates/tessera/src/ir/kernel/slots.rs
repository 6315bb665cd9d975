//! The one register allocator of the kernels' step lists: each step's
//! value gets a slot (a block of a fused kernel, a row of a row kernel),
//! and a slot is reused once the value in it has been read for the last
//! time. It is pure data over a step list: given what each step reads and
//! how long its value must stay, it returns each step's slot and the
//! number of slots.

/// How long a step's value holds a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hold {
    /// No slot: the value lives elsewhere (a constant read as a scalar, a
    /// per-row scalar).
    Nothing,
    /// From its step until its last reader has run; the slot then goes to
    /// a later step.
    UntilLastRead,
    /// From its step to the end of the steps, never given back (an output
    /// stored once every step has run).
    ToEnd,
    /// A slot of its own, taken before the first step and never shared
    /// with another value (a constant filled once before the steps run; an
    /// output still being stored while the next block's steps run).
    Own,
}

/// Each step's slot and the number of slots.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Slots {
    /// The slot of each step; `None` for a step that holds [`Hold::Nothing`].
    pub slot: Vec<Option<usize>>,
    pub count: usize,
}

/// Allocates slots for the steps `0..hold.len()`: step `i` reads the
/// earlier steps `operands(i)` and its value holds a slot as `hold[i]`
/// says. The [`Hold::Own`] slots come first, in step order. Every other
/// holding step takes a slot when it runs (one given back most recently,
/// else a new one) *before* its operands give theirs back, so a step
/// never writes the slot of a value it reads; a [`Hold::UntilLastRead`]
/// value gives its slot back right after its last reader (after its own
/// step when nothing reads it).
pub fn allocate(operands: impl Fn(usize) -> Vec<usize>, hold: &[Hold]) -> Slots {
    let n = hold.len();
    let reads: Vec<Vec<usize>> = (0..n).map(operands).collect();
    // The last step reading each value; its own index when none does.
    let mut last: Vec<usize> = (0..n).collect();
    for (i, read) in reads.iter().enumerate() {
        for &a in read {
            last[a] = last[a].max(i);
        }
    }
    let mut slot = vec![None; n];
    let mut count = 0;
    for i in (0..n).filter(|&i| hold[i] == Hold::Own) {
        slot[i] = Some(count);
        count += 1;
    }
    let mut free: Vec<usize> = Vec::new();
    for (i, read) in reads.iter().enumerate() {
        if matches!(hold[i], Hold::UntilLastRead | Hold::ToEnd) {
            slot[i] = Some(free.pop().unwrap_or_else(|| {
                count += 1;
                count - 1
            }));
        }
        let mut done = read.clone();
        done.push(i);
        done.sort_unstable();
        done.dedup();
        free.extend(
            done.into_iter()
                .filter(|&a| hold[a] == Hold::UntilLastRead && last[a] == i)
                .filter_map(|a| slot[a]),
        );
    }
    Slots { slot, count }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Checks what every allocation must keep: a step's slot held by an
    /// earlier value only once that value is dead (it gives its slot back
    /// and its last reader ran *before* this step), `Own` slots shared by
    /// no one, the `Nothing` steps without a slot and `count` the number
    /// of slots used.
    fn assert_sound(operands: &[Vec<usize>], hold: &[Hold], slots: &Slots) {
        let n = hold.len();
        let mut last: Vec<usize> = (0..n).collect();
        for (i, read) in operands.iter().enumerate() {
            for &a in read {
                last[a] = last[a].max(i);
            }
        }
        let mut used = vec![false; slots.count];
        for j in 0..n {
            assert_eq!(
                slots.slot[j].is_none(),
                hold[j] == Hold::Nothing,
                "step {j}"
            );
            let Some(s) = slots.slot[j] else { continue };
            used[s] = true;
            for i in 0..n {
                if i == j || slots.slot[i] != Some(s) {
                    continue;
                }
                assert!(
                    hold[i] != Hold::Own && hold[j] != Hold::Own,
                    "steps {i} and {j} share own slot {s}: {slots:?}"
                );
                if i < j {
                    assert!(
                        hold[i] == Hold::UntilLastRead && last[i] < j,
                        "step {j} overwrites slot {s} of step {i} (last read by {}): {slots:?}",
                        last[i]
                    );
                }
            }
        }
        assert!(used.iter().all(|&u| u), "unused slots: {slots:?}");
    }

    fn run(operands: &[Vec<usize>], hold: &[Hold]) -> Slots {
        let slots = allocate(|i| operands[i].clone(), hold);
        assert_sound(operands, hold, &slots);
        slots
    }

    #[test]
    fn a_slot_is_reused_after_its_last_read() {
        // x; a = f(x); b = g(a); c = h(b): two slots in turn.
        let ops = [vec![], vec![0], vec![1], vec![2]];
        let slots = run(&ops, &[Hold::UntilLastRead; 4]);
        assert_eq!(slots.slot, [Some(0), Some(1), Some(0), Some(1)]);
        assert_eq!(slots.count, 2);
        // x read again by the last step keeps its slot until then.
        let ops = [vec![], vec![0], vec![1], vec![2, 0]];
        let slots = run(&ops, &[Hold::UntilLastRead; 4]);
        assert_eq!(slots.slot, [Some(0), Some(1), Some(2), Some(1)]);
        assert_eq!(slots.count, 3);
    }

    #[test]
    fn a_step_never_writes_a_slot_it_reads() {
        // Each step is the last reader of its operands: it still takes a
        // slot of its own, and gets theirs back only after.
        let ops = [vec![], vec![], vec![0, 1], vec![2], vec![3, 3]];
        let slots = run(&ops, &[Hold::UntilLastRead; 5]);
        for (i, read) in ops.iter().enumerate() {
            for &a in read {
                assert_ne!(slots.slot[i], slots.slot[a], "step {i} reads step {a}");
            }
        }
        assert_eq!(slots.slot, [Some(0), Some(1), Some(2), Some(1), Some(2)]);
    }

    #[test]
    fn outputs_are_never_overwritten() {
        // o = f(x) is an output read by nothing; the steps after it all
        // find other slots.
        let ops = [vec![], vec![0], vec![0], vec![2], vec![3]];
        let mut hold = [Hold::UntilLastRead; 5];
        hold[1] = Hold::ToEnd;
        let slots = run(&ops, &hold);
        let o = slots.slot[1];
        assert!((2..5).all(|j| slots.slot[j] != o), "{slots:?}");
        // An output read by later steps is kept after its last read too.
        let ops = [vec![], vec![0], vec![1], vec![2], vec![3]];
        let mut hold = [Hold::UntilLastRead; 5];
        hold[1] = Hold::ToEnd;
        let slots = run(&ops, &hold);
        assert!((3..5).all(|j| slots.slot[j] != slots.slot[1]), "{slots:?}");
    }

    #[test]
    fn own_slots_come_first_and_are_shared_with_no_one() {
        // A constant read by two steps and a streamed output computed
        // late: both have their slots from the start, numbered first.
        let ops = [vec![], vec![], vec![0, 1], vec![2], vec![3, 1], vec![4]];
        let hold = [
            Hold::UntilLastRead,
            Hold::Own,
            Hold::UntilLastRead,
            Hold::UntilLastRead,
            Hold::Own,
            Hold::Nothing,
        ];
        let slots = run(&ops, &hold);
        assert_eq!((slots.slot[1], slots.slot[4]), (Some(0), Some(1)));
        assert_eq!(slots.slot[5], None);
        assert_eq!(slots.count, 4);
    }

    #[test]
    fn random_step_lists_are_allocated_soundly() {
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = |m: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % m as u64) as usize
        };
        for _ in 0..500 {
            let n = 1 + next(24);
            let ops: Vec<Vec<usize>> = (0..n)
                .map(|i| match i {
                    0 => vec![],
                    _ => (0..next(4)).map(|_| next(i)).collect(),
                })
                .collect();
            let hold: Vec<Hold> = (0..n)
                .map(|_| match next(8) {
                    0..=4 => Hold::UntilLastRead,
                    5 => Hold::Nothing,
                    6 => Hold::ToEnd,
                    _ => Hold::Own,
                })
                .collect();
            run(&ops, &hold);
        }
    }
}
