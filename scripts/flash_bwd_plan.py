"""The wgmma backward's launch plan of the Rust launcher (crates/tessera-cuda/src/flash/work.rs:
backward_split, tail_split, backward_group, backward_plan), mirrored for the CuPy harnesses;
keep the two in step.

split(bh, nq, nk, sms, causal) -> (items, whole, splits): the first `whole` (batch x head,
key block) items take a block each, every later item `splits` blocks.
group(bh, nq, nk, sms) -> batch x heads per launch group.
plan(bh, nq, nk, sms, causal) -> (lanes, groups): the groups alternate over `lanes` streams
and workspaces; only the last one splits (its share of all groups' items past the last
whole wave).
"""
import math
TILE_ROWS = 64
KEYS = 128
LANES = 2  # flash.rs LANES
ACC = 32 << 20  # flash.rs ACC_BUDGET
def tail_split(bh, nq, nk, sms, causal, tail):
    """flash.rs tail_split: the last `tail` items in as many pieces as fill one wave."""
    items = -(-nk//KEYS)*bh
    none=(items, items, 1)
    if causal or tail==0 or tail>=items: return none
    s=min(sms//tail, (-(-nq//TILE_ROWS))//2)
    return (items, items-tail, s) if s>=2 else none
def split(bh, nq, nk, sms, causal):
    items = -(-nk//KEYS)*bh
    if items==0: return (items, items, 1)
    a = min(sms//items, (-(-nq//TILE_ROWS))//2)
    if a>=2: return (items,0,a)
    return tail_split(bh, nq, nk, sms, causal, items % sms)
def group(bh, nq, nk, sms, acc=ACC):
    per=-(-nq//TILE_ROWS)*TILE_ROWS*128*4
    if bh*per<=acc: return max(bh,1)
    return max(1, min(acc//LANES//per, bh))
def plan(bh, nq, nk, sms, causal, acc=ACC):
    """flash.rs backward_plan: (lanes, [(first, n, (items, whole, splits))])."""
    g=group(bh, nq, nk, sms, acc)
    if g>=bh: return 1, [(0, bh, split(bh, nq, nk, sms, causal))]
    tail=(-(-nk//KEYS)*bh) % sms
    return LANES, [(f, min(g, bh-f), tail_split(min(g, bh-f), nq, nk, sms, causal,
                                                 tail if f+g>=bh else 0))
                   for f in range(0, bh, g)]
if __name__=="__main__":
    for (bh,nq,nk) in [(256,2048,2048),(256,2048,1000),(33,2048,1000),(40,2048,2048),(64,2048,2048),(1,2048,2048),(128,4096,4096),(96,1024,1024),(268,256,100)]:
        lanes, groups = plan(bh,nq,nk,132,False)
        print(bh,nq,nk,"lanes",lanes,"groups",[(f,n,sp) for f,n,sp in groups if sp[2]>1 or f==0])
