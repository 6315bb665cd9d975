//! Which buffers a plan's kernels create and read, whatever the order.
//!
//! A buffer is the storage a kernel allocates for an output value, or the
//! scratch a kernel uses while it runs. A view (permute, slice, a reshape
//! or `contiguous` that needs no copy …) is no buffer: it reads the buffer
//! of the value it views, which therefore lives as long as any view of it
//! is read — as the runtime's reference-counted storages do. Graph inputs
//! are the caller's and are in no buffer; graph outputs' buffers live to the
//! end. Layouts are followed from the inputs, assumed dense (the compiled
//! function's inputs are; a strided input may make a reshape copy where the
//! plan expected a view).
//!
//! Scratch is the kernels' of the device the plan is made for: the CPU's
//! ([`crate::runtime::cpu::scratch_bytes`]) or a device backend's
//! ([`crate::runtime::device::Backend::scratch_bytes`]), so that a plan
//! for a device reserves what that device's kernels allocate, no more.
//!
//! Cat in place: when every input of a `cat` is a whole dense buffer that
//! a kernel of this executable makes, that only the cat reads, and the cat
//! joins them along a dim with only size-1 dims before it (so each input is
//! one contiguous byte range of the output), each input buffer is planned
//! *within* the cat's output buffer, at its range: its producer writes
//! straight into the output, and the cat copies nothing.
//!
//! Donated inputs: a graph input the caller hands over (its only handle,
//! `Compiled::try_call_donating`) is a buffer created by no kernel, alive
//! from the start to its last read: a fused kernel reading it for the last
//! time may write an output of its size and dtype over it, as over any
//! intermediate — a graph output too, which then lives in the caller's
//! storage (see `memory.rs`). It is never planned within a cat's output.

use super::kernels::KernelGraph;
use super::Donations;
use crate::error::{Error, ErrorKind, Result};
use crate::fusion::{Kernel, Plan};
use crate::ir::{DType, Graph, NodeId, Op};
use crate::runtime::cpu::{self, copy, view_layout};
use crate::runtime::device::{self, Backend, Device};
use crate::tensor::Layout;
use std::sync::Arc;

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Buffer {
    /// The value stored; `None` for scratch.
    pub value: Option<NodeId>,
    /// The kernel that creates it.
    pub kernel: usize,
    pub bytes: usize,
    /// Kernels that read it (through the value or any view of it).
    pub readers: Vec<usize>,
    /// Lives to the end (a graph output is, or views, it).
    pub pinned: bool,
    /// It is the bytes at (.1) of buffer (.0), the output of a cat in place.
    pub within: Option<(usize, usize)>,
    /// It is the storage of a graph input the caller donated: created by
    /// no kernel (`kernel` means nothing), live from the start.
    pub donated: bool,
}

/// A fused kernel may write output `output` (position in its outputs) into
/// `buffer`, which its input `input` reads, if, in the chosen order, that
/// buffer is read for the last time by this kernel alone (see `memory.rs`).
/// `input` is the value the kernel reads — a view of the buffer's value
/// (a reshape, say) as often as the value itself — and is what the executor
/// hands over: naming the buffer's own value there would leave the
/// executor without the donation and every later allocation of the kernel
/// one slot off.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct InPlace {
    pub input: NodeId,
    /// The position of the output among the kernel's fused outputs.
    pub output: usize,
    pub buffer: usize,
    /// The output's buffer.
    pub output_buffer: usize,
}

/// A value's layout as the runtime will make it.
#[derive(Clone, Debug)]
struct ValueLayout {
    layout: Layout,
    dtype: DType,
    /// Elements of the storage it views.
    storage_numel: usize,
    buffer: Option<usize>,
}

pub(crate) struct BufferModel {
    pub buffers: Vec<Buffer>,
    /// Per node, the buffer its value lives in.
    pub value_buffer: Vec<Option<usize>>,
    /// Per kernel, the buffers it creates (outputs and scratch).
    pub created: Vec<Vec<usize>>,
    /// Per kernel, the buffers it reads.
    pub read: Vec<Vec<usize>>,
    /// Per kernel, the in-place writes its layouts allow.
    pub in_place: Vec<Vec<InPlace>>,
    /// Per kernel, whether it is a cat whose inputs are planned within its
    /// output (it copies nothing).
    pub joins: Vec<bool>,
    /// Per kernel, the stream its hints put it on (0: the run's own; see
    /// `schedule::streams`), which decides when memory it used is free.
    pub stream_of: Vec<usize>,
    /// The device whose kernels' scratch the model reserves.
    pub device: Device,
    /// Its backend.
    backend: Arc<dyn Backend>,
}

impl BufferModel {
    /// The buffers of `plan` run on `device` (errors when no backend is
    /// registered for it), the graph inputs at positions `donated` handed
    /// over by the caller.
    pub fn new(
        graph: &Graph,
        plan: &Plan,
        kg: &KernelGraph,
        on: Device,
        donated: &Donations,
    ) -> Result<BufferModel> {
        let backend = device::backend(on)?;
        let mut model = BufferModel {
            device: on,
            backend,
            buffers: Vec::new(),
            value_buffer: vec![None; graph.len()],
            created: vec![Vec::new(); kg.len()],
            read: vec![Vec::new(); kg.len()],
            in_place: vec![Vec::new(); kg.len()],
            joins: vec![false; kg.len()],
            stream_of: vec![0; kg.len()],
        };
        let mut values: Vec<Option<ValueLayout>> = vec![None; graph.len()];
        for (i, &id) in graph.inputs.iter().enumerate() {
            let shape = concrete(graph, id)?;
            let numel: usize = shape.iter().product();
            let dtype = graph.node(id).ty.dtype;
            let buffer = donated.contains(i).then(|| {
                model.buffers.push(Buffer {
                    value: Some(id),
                    kernel: 0,
                    bytes: numel * dtype.size_bytes(),
                    readers: Vec::new(),
                    pinned: false,
                    within: None,
                    donated: true,
                });
                model.buffers.len() - 1
            });
            model.value_buffer[id.index()] = buffer;
            values[id.index()] = Some(ValueLayout {
                storage_numel: numel,
                layout: Layout::contiguous(&shape),
                dtype,
                buffer,
            });
        }
        for (k, kernel) in plan.kernels.iter().enumerate() {
            model.add_kernel(graph, k, kernel, &mut values)?;
        }
        for out in &graph.outputs {
            if let Some(b) = model.value_buffer[out.node.index()] {
                model.buffers[b].pinned = true;
            }
        }
        for (k, kernel) in plan.kernels.iter().enumerate() {
            if let Kernel::Custom { .. } = kernel {
                model.never_overwrite_outputs_of_equal_size(k);
            }
        }
        for (k, kernel) in plan.kernels.iter().enumerate() {
            if let Kernel::Extern(id) = kernel {
                model.join_in_place(graph, k, *id);
            }
        }
        model.keep_pairs(graph, donated);
        model.check_total(graph)?;
        Ok(model)
    }

    /// Every offset, arena size and peak the planner computes is at most
    /// the sum of all buffers, each rounded up to the alignment: checking
    /// once that this sum fits an `isize` (Rust's limit on one allocation)
    /// makes all of that arithmetic safe. (Each buffer is within the size
    /// limit already: see [`concrete`].)
    fn check_total(&self, graph: &Graph) -> Result<()> {
        let total = self.buffers.iter().try_fold(0usize, |acc, b| {
            acc.checked_add(b.bytes.checked_next_multiple_of(64)?.checked_add(64)?)
        });
        match total {
            Some(t) if t <= isize::MAX as usize => Ok(()),
            _ => Err(Error::new(
                ErrorKind::OutOfMemory,
                format!(
                    "graph `{}`: its {} buffers together need more bytes than one \
                     address space holds; it cannot be planned",
                    graph.name,
                    self.buffers.len()
                ),
            )),
        }
    }

    /// A custom op's kernel allocates its outputs in an order of its own:
    /// outputs of equal size may land in each other's arena slots (the
    /// executor then moves such an output to the pool). None of them is
    /// written in place by a later kernel: the value written there would
    /// live on wherever its donor really is, past the lifetime the plan gave
    /// that place (found by the gradient proptest of compile_differential.rs).
    fn never_overwrite_outputs_of_equal_size(&mut self, k: usize) {
        let outputs: Vec<usize> = self.created[k]
            .iter()
            .copied()
            .filter(|&b| self.buffers[b].value.is_some())
            .collect();
        let alike: Vec<usize> = outputs
            .iter()
            .copied()
            .filter(|&b| {
                let bytes = self.buffers[b].bytes;
                outputs
                    .iter()
                    .filter(|&&o| self.buffers[o].bytes == bytes)
                    .count()
                    > 1
            })
            .collect();
        for candidates in &mut self.in_place {
            candidates.retain(|c| !alike.contains(&c.buffer));
        }
    }

    /// A donated input paired with an output ([`Donations::becomes`]) may
    /// take that output alone, and a paired output goes over no other
    /// buffer.
    fn keep_pairs(&mut self, graph: &Graph, donated: &Donations) {
        let pairs: Vec<(usize, NodeId)> = donated
            .becomes
            .iter()
            .filter_map(|&(i, o)| {
                let buffer = self.value_buffer[graph.inputs.get(i)?.index()]?;
                Some((buffer, graph.outputs.get(o)?.node))
            })
            .collect();
        if pairs.is_empty() {
            return;
        }
        let buffers = &self.buffers;
        for candidates in &mut self.in_place {
            candidates.retain(|c| {
                let out = buffers[c.output_buffer].value;
                match pairs.iter().find(|&&(b, _)| b == c.buffer) {
                    Some(&(_, paired)) => out == Some(paired),
                    None => !pairs.iter().any(|&(_, paired)| out == Some(paired)),
                }
            });
        }
    }

    /// Plans the inputs of cat `id` (kernel `k`) within its output, if they
    /// all qualify (see the module docs).
    fn join_in_place(&mut self, graph: &Graph, k: usize, id: NodeId) {
        let node = graph.node(id);
        let Op::Cat { dim } = node.op else { return };
        let Some(out) = self.value_buffer[id.index()] else {
            return;
        };
        let Some(shape) = node.ty.shape.as_concrete() else {
            return;
        };
        if shape[..dim].iter().product::<usize>() != 1 || self.buffers[out].value != Some(id) {
            return;
        }
        let mut pieces = Vec::new();
        let mut offset = 0;
        for &x in &node.inputs {
            let Some(b) = self.value_buffer[x.index()] else {
                return;
            };
            let buffer = &self.buffers[b];
            let whole = buffer.value == Some(x) && buffer.within.is_none();
            if !whole
                || buffer.pinned
                || buffer.donated
                || buffer.readers != [k]
                || pieces.iter().any(|&(p, _)| p == b)
            {
                return;
            }
            pieces.push((b, offset));
            offset += buffer.bytes;
        }
        if offset != self.buffers[out].bytes {
            return;
        }
        for (b, at) in pieces {
            self.buffers[b].within = Some((out, at));
        }
        self.joins[k] = true;
    }

    fn add_kernel(
        &mut self,
        graph: &Graph,
        k: usize,
        kernel: &Kernel,
        values: &mut [Option<ValueLayout>],
    ) -> Result<()> {
        let reads = kernel.reads(graph);
        let inputs: Vec<&ValueLayout> = reads
            .iter()
            .map(|v| {
                values[v.index()].as_ref().ok_or_else(|| {
                    internal(format!(
                        "kernel k{k} reads {} before it is made",
                        graph.display_name(*v)
                    ))
                })
            })
            .collect::<Result<_>>()?;
        for b in inputs.iter().filter_map(|v| v.buffer) {
            self.note_read(k, b);
        }
        match kernel {
            Kernel::Extern(id) => {
                let (value, scratch) = self.extern_output(graph, k, *id, &inputs)?;
                if scratch > 0 {
                    self.create(k, None, scratch);
                }
                self.value_buffer[id.index()] = value.buffer;
                values[id.index()] = Some(value);
            }
            Kernel::Custom { .. } | Kernel::Rows { .. } => {
                // Every output in a buffer of its own (a custom op is
                // opaque; a row kernel writes only its outputs).
                for o in kernel.writes() {
                    let value = self.new_value(graph, k, o)?;
                    self.value_buffer[o.index()] = value.buffer;
                    values[o.index()] = Some(value);
                }
            }
            Kernel::Epilogue {
                matmul,
                matmul_out,
                product_into,
                kernel: code,
                outputs,
                ..
            } => {
                // The gemm's own scratch, then its product: an output of the
                // kernel when needed elsewhere, else overwritten by the first
                // epilogue output of its dtype, else the kernel's scratch
                // (the executor runs such a gemm inside `arena::scratch`).
                let n = graph.node(*matmul).inputs.len();
                let operand_buffers: Vec<Option<usize>> =
                    inputs[..n].iter().map(|v| v.buffer).collect();
                let shape = concrete(graph, *matmul)?;
                let described: Vec<(&Layout, DType, usize)> = inputs[..n]
                    .iter()
                    .map(|v| (&v.layout, v.dtype, v.storage_numel))
                    .collect();
                let dtype = graph.node(*matmul).ty.dtype;
                let mut scratch = self.scratch_bytes(&graph.node(*matmul).op, &described, &shape);
                if !*matmul_out && product_into.is_none() {
                    let numel: usize = shape.iter().product();
                    scratch = scratch.div_ceil(64) * 64 + numel * dtype.size_bytes();
                }
                if scratch > 0 {
                    self.create(k, None, scratch);
                }
                if *matmul_out {
                    let value = self.new_value(graph, k, *matmul)?;
                    self.value_buffer[matmul.index()] = value.buffer;
                    values[matmul.index()] = Some(value);
                }
                let first_output = self.created[k].len();
                for &o in outputs {
                    let value = self.new_value(graph, k, o)?;
                    self.value_buffer[o.index()] = value.buffer;
                    values[o.index()] = Some(value);
                }
                // A donated input the epilogue alone reads may take an
                // output other than the one written over the product.
                let epilogue_inputs: Vec<NodeId> = reads[n..].to_vec();
                let candidates = in_place_candidates(
                    &code.shape,
                    &epilogue_inputs,
                    (outputs, &self.created[k][first_output..]),
                    graph,
                    values,
                );
                self.in_place[k] = candidates
                    .into_iter()
                    .filter(|c| {
                        Some(c.output) != *product_into
                            && self.buffers[c.buffer].donated
                            && !operand_buffers.contains(&Some(c.buffer))
                    })
                    .collect();
            }
            Kernel::MatmulRows {
                matmuls,
                kernel: code,
                outputs,
                ..
            } => {
                let scratch = self.matmul_rows_scratch(graph, matmuls, code.wide, &inputs)?;
                if scratch > 0 {
                    self.create(k, None, scratch);
                }
                for &o in outputs {
                    let value = self.new_value(graph, k, o)?;
                    self.value_buffer[o.index()] = value.buffer;
                    values[o.index()] = Some(value);
                }
            }
            Kernel::Fused {
                kernel: code,
                inputs: fused_inputs,
                outputs,
                ..
            } => {
                for &o in outputs {
                    let value = self.new_value(graph, k, o)?;
                    self.value_buffer[o.index()] = value.buffer;
                    values[o.index()] = Some(value);
                }
                let first_output = self.created[k].len() - outputs.len();
                self.in_place[k] = in_place_candidates(
                    &code.shape,
                    fused_inputs,
                    (outputs, &self.created[k][first_output..]),
                    graph,
                    values,
                );
            }
        }
        Ok(())
    }

    /// The scratch of a matmul row kernel (`inputs`: the matmuls'
    /// operands first). Products the backend hands to the row kernel block
    /// by block (the CPU's thin f32 products) are never allocated (their blocks are the tasks' own, like the
    /// row kernel's registers); otherwise each product is made whole,
    /// after its matmul's own scratch, in the kernel's scratch region
    /// (`execute::run_matmul_rows`), every piece at a 64-byte boundary.
    fn matmul_rows_scratch(
        &self,
        graph: &Graph,
        matmuls: &[NodeId],
        wide: bool,
        inputs: &[&ValueLayout],
    ) -> Result<usize> {
        let mut products = Vec::new();
        let mut at = 0;
        for &m in matmuls {
            let node = graph.node(m);
            let n = node.inputs.len();
            let described: Vec<(&Layout, DType, usize)> = inputs[at..at + n]
                .iter()
                .map(|v| (&v.layout, v.dtype, v.storage_numel))
                .collect();
            at += n;
            products.push((node, described, concrete(graph, m)?));
        }
        let blocked = !wide
            && self.backend.feeds_products(
                &products
                    .iter()
                    .map(|(node, d, shape)| {
                        let operands = [(d[0].0, d[0].1), (d[1].0, d[1].1)];
                        (operands, cpu::transposes(&node.op), shape.as_slice())
                    })
                    .collect::<Vec<_>>(),
            );
        if blocked {
            return Ok(0);
        }
        let mut used: usize = 0;
        for (node, described, shape) in &products {
            let own = self.scratch_bytes(&node.op, described, shape);
            let numel: usize = shape.iter().product();
            used = used.div_ceil(64) * 64 + own;
            used = used.div_ceil(64) * 64 + numel * node.ty.dtype.size_bytes();
        }
        Ok(used)
    }

    fn note_read(&mut self, k: usize, b: usize) {
        if !self.read[k].contains(&b) {
            self.read[k].push(b);
            self.buffers[b].readers.push(k);
        }
    }

    /// The output of extern kernel `k` (node `id`): a view of its first
    /// input's buffer or a new buffer, and the scratch bytes it needs.
    fn extern_output(
        &mut self,
        graph: &Graph,
        k: usize,
        id: NodeId,
        inputs: &[&ValueLayout],
    ) -> Result<(ValueLayout, usize)> {
        let node = graph.node(id);
        let shape = concrete(graph, id)?;
        let described: Vec<(&Layout, DType, usize)> = inputs
            .iter()
            .map(|v| (&v.layout, v.dtype, v.storage_numel))
            .collect();
        let scratch = if described.is_empty() {
            0
        } else {
            self.scratch_bytes(&node.op, &described, &shape)
        };
        let view = described
            .first()
            .and_then(|&input| view_layout(&node.op, input, &shape));
        let value = match view {
            Some(layout) => ValueLayout {
                layout,
                dtype: node.ty.dtype,
                storage_numel: inputs[0].storage_numel,
                buffer: inputs[0].buffer,
            },
            None => self.new_value(graph, k, id)?,
        };
        Ok((value, scratch))
    }

    /// Bytes `op`'s kernel allocates besides its output on the model's
    /// device.
    fn scratch_bytes(
        &self,
        op: &Op,
        inputs: &[(&Layout, DType, usize)],
        out_shape: &[usize],
    ) -> usize {
        self.backend.scratch_bytes(op, inputs, out_shape)
    }

    fn new_value(&mut self, graph: &Graph, k: usize, id: NodeId) -> Result<ValueLayout> {
        let shape = concrete(graph, id)?;
        let numel: usize = shape.iter().product();
        let dtype = graph.node(id).ty.dtype;
        let buffer = self.create(k, Some(id), numel * dtype.size_bytes());
        Ok(ValueLayout {
            layout: Layout::contiguous(&shape),
            dtype,
            storage_numel: numel,
            buffer: Some(buffer),
        })
    }

    fn create(&mut self, k: usize, value: Option<NodeId>, bytes: usize) -> usize {
        self.buffers.push(Buffer {
            value,
            kernel: k,
            bytes,
            readers: Vec::new(),
            pinned: false,
            within: None,
            donated: false,
        });
        self.created[k].push(self.buffers.len() - 1);
        self.buffers.len() - 1
    }
}

/// Inputs of a fused kernel that an output of the same dtype may overwrite:
/// the input is a whole buffer, dense, of the kernel's shape (so element i
/// of the input is element i of the output), read once by the kernel.
/// `outputs`: the fused outputs and their buffers.
fn in_place_candidates(
    shape: &[usize],
    inputs: &[NodeId],
    (outputs, output_buffers): (&[NodeId], &[usize]),
    graph: &Graph,
    values: &[Option<ValueLayout>],
) -> Vec<InPlace> {
    let value = |v: NodeId| values[v.index()].as_ref().expect("made before use");
    let mut found = Vec::new();
    for &x in inputs {
        let vx = value(x);
        let Some(buffer) = vx.buffer else { continue };
        let read_once = inputs
            .iter()
            .filter(|&&y| value(y).buffer == Some(buffer))
            .count()
            == 1;
        let whole = vx.layout.shape == shape && copy::is_dense(&vx.layout, vx.storage_numel);
        if !(read_once && whole) {
            continue;
        }
        for (o, &out) in outputs.iter().enumerate() {
            if graph.node(out).ty.dtype == vx.dtype {
                found.push(InPlace {
                    input: x,
                    output: o,
                    buffer,
                    output_buffer: output_buffers[o],
                });
            }
        }
    }
    prefer_own_inputs(&mut found, inputs, outputs, graph);
    found
}

/// Orders the candidates (the memory plan takes the first that fits, per
/// input and output) so that each output goes over an input it is computed
/// from, the outputs with the fewest such inputs choosing first. A fused
/// optimizer update reads `p, g, m, v` and writes `p', m', v'`, all of one
/// size: in input order `m` could take `p'` and `p` take `v'`, and a
/// training step would hand its new moments back in each other's storage
/// (a device-graph replay, which records the buffers, then has to copy);
/// `m'` is computed from `m` and `g` only, `v'` from `v` and `g`, `p'`
/// from all: this order gives each its own.
fn prefer_own_inputs(found: &mut [InPlace], inputs: &[NodeId], outputs: &[NodeId], graph: &Graph) {
    let reads: Vec<Vec<NodeId>> = outputs
        .iter()
        .map(|&out| inputs_reached(graph, out, inputs))
        .collect();
    let choices = |o: usize| {
        found
            .iter()
            .filter(|c| c.output == o && reads[o].contains(&c.input))
            .count()
    };
    let choices: Vec<usize> = (0..outputs.len()).map(choices).collect();
    // Stable: otherwise the input order stays.
    found.sort_by_key(|c| {
        let own = reads[c.output].contains(&c.input);
        (!own, if own { choices[c.output] } else { 0 })
    });
}

/// The kernel inputs (of `inputs`) that `out` is computed from within the
/// kernel: the graph walked back from `out`, stopping at them.
fn inputs_reached(graph: &Graph, out: NodeId, inputs: &[NodeId]) -> Vec<NodeId> {
    let mut seen = std::collections::HashSet::new();
    let mut stack = vec![out];
    let mut reached = Vec::new();
    while let Some(id) = stack.pop() {
        if !seen.insert(id) {
            continue;
        }
        if inputs.contains(&id) {
            reached.push(id);
            continue;
        }
        stack.extend(graph.node(id).inputs.iter().copied());
    }
    reached
}

/// The shape of `id`, concrete and within the size limit
/// ([`crate::limits`]), so its byte size cannot overflow.
fn concrete(graph: &Graph, id: NodeId) -> Result<Vec<usize>> {
    let ty = &graph.node(id).ty;
    let shape = ty.shape.as_concrete().ok_or_else(|| {
        Error::new(
            ErrorKind::Unsupported,
            format!(
                "memory planning needs concrete shapes; {} is {ty}",
                graph.display_name(id)
            ),
        )
    })?;
    crate::limits::check(graph.node(id).op.name(), ty.dtype, &shape)?;
    Ok(shape)
}

fn internal(message: String) -> Error {
    Error::new(ErrorKind::Verify, format!("internal error: {message}"))
}
