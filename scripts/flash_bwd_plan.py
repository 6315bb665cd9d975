"""The wgmma backward's launch plan of the Rust launcher (crates/tessera-cuda/src/flash.rs:
backward_split, backward_group), mirrored for the CuPy harnesses; keep the two in step.

split(bh, nq, nk, sms, causal) -> (items, whole, splits): the first `whole` (batch x head,
key block) items take a block each, every later item `splits` blocks.
group(bh, nq, nk, sms) -> batch x heads per launch group.
"""
import math
TILE_ROWS = 64
KEYS = 128
GROUP_WAVES = 0.2  # flash.rs GROUP_WAVES
PIECE_WAVES = 0.03  # flash.rs PIECE_WAVES
ACC = 32 << 20  # flash.rs ACC_BUDGET
def split(bh, nq, nk, sms, causal):
    items = -(-nk//KEYS)*bh
    none=(items, items, 1)
    if items==0: return none
    maxs = (-(-nq//TILE_ROWS))//2
    a = min(sms//items, maxs)
    if a>=2: return (items,0,a)
    tail = items % sms
    if causal or tail==0: return none
    s=min(sms//tail, maxs)
    return (items, items-tail, s) if s>=2 else none
def waves(sp, sms):
    items,whole,s=sp
    pieces=(items-whole)*s
    return -(-whole//sms) + (-(-pieces//sms))*(1 / s + PIECE_WAVES)
def group(bh, nq, nk, sms, acc=ACC):
    per=-(-nq//TILE_ROWS)*TILE_ROWS*128*4
    budget=max(1,min(acc//per,bh))
    if budget==bh: return bh
    def w(g):
        L=lambda n: waves(split(n,nq,nk,sms,False),sms)+GROUP_WAVES
        return (bh//g)*L(g)+(L(bh%g) if bh%g else 0)
    best=(budget,w(budget))
    for g in list(range(budget, -(-budget//2)-1, -1))+list(range(budget+1, min(budget+budget//16,bh)+1)):
        x=w(g)
        if x<best[1]-1e-9: best=(g,x)
    return best[0]
if __name__=="__main__":
    for (bh,nq,nk) in [(256,2048,2048),(256,2048,1000),(33,2048,1000),(40,2048,2048),(64,2048,2048),(1,2048,2048),(128,4096,4096),(96,1024,1024)]:
        g=group(bh,nq,nk,132)
        print(bh,nq,nk,"group",g, "splits", [split(n,nq,nk,132,False) for n in sorted({g, bh%g}-{0})])
