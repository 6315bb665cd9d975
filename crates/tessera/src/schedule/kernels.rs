//! The dependency graph between a plan's kernels, and the dfs order (the
//! other ranks are the kernels' indices, which are program order, and the
//! bfs steps, which the list scheduler finds as it goes).

use crate::fusion::Plan;
use crate::ir::Graph;

pub(crate) struct KernelGraph {
    /// Per kernel, the kernels whose values it reads, in operand order.
    pub producers: Vec<Vec<usize>>,
    /// Per kernel, the kernels that read its values, ascending.
    pub consumers: Vec<Vec<usize>>,
    /// Position in the dfs order.
    pub dfs_rank: Vec<usize>,
}

impl KernelGraph {
    pub fn new(graph: &Graph, plan: &Plan) -> KernelGraph {
        let n = plan.kernels.len();
        let mut kernel_of = vec![None; graph.len()];
        for (k, kernel) in plan.kernels.iter().enumerate() {
            for v in kernel.writes() {
                kernel_of[v.index()] = Some(k);
            }
        }
        let mut producers = vec![Vec::new(); n];
        let mut consumers = vec![Vec::new(); n];
        for (k, kernel) in plan.kernels.iter().enumerate() {
            for v in kernel.reads(graph) {
                if let Some(p) = kernel_of[v.index()] {
                    if !producers[k].contains(&p) {
                        producers[k].push(p);
                        consumers[p].push(k);
                    }
                }
            }
        }
        let roots: Vec<usize> = graph
            .outputs
            .iter()
            .filter_map(|o| kernel_of[o.node.index()])
            .collect();
        let dfs_rank = dfs_ranks(&producers, &roots);
        KernelGraph {
            producers,
            consumers,
            dfs_rank,
        }
    }

    pub fn len(&self) -> usize {
        self.producers.len()
    }
}

/// Post-order from `roots` (producers in operand order), then the kernels no
/// output needs in program order: what one consumer needs is finished before
/// the next consumer's chain starts.
fn dfs_ranks(producers: &[Vec<usize>], roots: &[usize]) -> Vec<usize> {
    let n = producers.len();
    let mut rank = vec![usize::MAX; n];
    let mut next = 0;
    let mut visited = vec![false; n];
    for &root in roots {
        // (kernel, index of the next producer to visit)
        let mut stack = vec![(root, 0usize)];
        visited[root] = true;
        while let Some(&mut (k, ref mut i)) = stack.last_mut() {
            if let Some(&p) = producers[k].get(*i) {
                *i += 1;
                if !visited[p] {
                    visited[p] = true;
                    stack.push((p, 0));
                }
            } else {
                rank[k] = next;
                next += 1;
                stack.pop();
            }
        }
    }
    for r in rank.iter_mut().filter(|r| **r == usize::MAX) {
        *r = next;
        next += 1;
    }
    rank
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dfs_finishes_one_operand_before_the_next() {
        // 0 → 1 → 4, 2 → 3 → 4 (4 reads 1 then 3); 5 is dead.
        let producers = vec![vec![], vec![0], vec![], vec![2], vec![1, 3], vec![]];
        assert_eq!(dfs_ranks(&producers, &[4]), vec![0, 1, 2, 3, 4, 5]);
        // Reading 3 first runs its chain first.
        let producers = vec![vec![], vec![0], vec![], vec![2], vec![3, 1], vec![]];
        assert_eq!(dfs_ranks(&producers, &[4]), vec![2, 3, 0, 1, 4, 5]);
    }
}
