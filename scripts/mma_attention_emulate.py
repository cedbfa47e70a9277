#!/usr/bin/env python3
"""Emulates the fragment mappings of `attention_mma::mla_attention_mma_kernel` (crates/quant/src/cuda/attention_mma.rs)
for one head tile of 16 heads and one slice, in f64, and compares with the plain attention: the `mma.m16n8k16`
A/B/C register layouts of PTX lane by lane, `perm8`, the k-slot order of the queries and latents (dims 4c.. in
slots 2c, 2c + 1, 2c + 8, 2c + 9), the scores' split over 4 warps, the online softmax on score fragments, P's A
fragments from the score fragments, and the value dimensions interleaved within each 32 (n-tile e = dims 4n + e).
No splitting into BF16 parts (the split is exact; `split_exact` below checks the truncation split on random floats).
Run it after changing any of those mappings, before a GPU run (numpy only; a few seconds). `positions_as_m` emulates
the planned few-heads orientation (positions as M, P transposed by shuffles; not yet a kernel).

usage: python3 scripts/mma_attention_emulate.py
"""
import struct
import random

import numpy as np

# One head tile (16 heads) over one slice of L positions, latents r + rot.
rng=np.random.default_rng(1)
r,rot=512,64; d=r+rot; H=16; L=37; scale=0.07
q=rng.uniform(-1,1,(H,d)); lat=rng.uniform(-1,1,(L,d))
def perm8(x):
    low=x&3; sw=((low&1)<<1)|(low>>1); return (x&4)|(sw^((x>>1)&2))
assert sorted(perm8(x) for x in range(8))==list(range(8))
def mma(ra,rb,cc):
    # ra[lane]=[(a0,a1),(a2,a3),(a4,a5),(a6,a7)], rb[lane]=[(b0,b1),(b2,b3)], cc[lane]=[c0..c3]
    A=np.zeros((16,16)); B=np.zeros((16,8))
    for lane in range(32):
        g,c=lane//4,lane%4
        A[g,2*c:2*c+2]=ra[lane][0]; A[g+8,2*c:2*c+2]=ra[lane][1]; A[g,2*c+8:2*c+10]=ra[lane][2]; A[g+8,2*c+8:2*c+10]=ra[lane][3]
        B[2*c:2*c+2,g]=rb[lane][0]; B[2*c+8:2*c+10,g]=rb[lane][1]
    C=A@B
    out=[]
    for lane in range(32):
        g,c=lane//4,lane%4
        x=cc[lane]; out.append([x[0]+C[g,2*c],x[1]+C[g,2*c+1],x[2]+C[g+8,2*c],x[3]+C[g+8,2*c+1]])
    return out
kq=d//64; nj=r//128
nst=(L+15)//16
# per warp kw state
O={kw:[[0.0]*(16*nj) for _ in range(32)] for kw in range(4)}
m=[[-1e30,-1e30] for _ in range(32)]; l=[[0.0,0.0] for _ in range(32)]
for st in range(nst):
    t0=st*16
    tile=np.zeros((16,d)); n=min(16,L-t0); tile[:n]=lat[t0:t0+n]
    parts=[]
    for kw in range(4):
        s=[[0.0]*8 for _ in range(32)]
        for i in range(kq):
            kk=kw*kq+i
            for nt in range(2):
                ra=[];rb=[]
                for lane in range(32):
                    g,c=lane//4,lane%4
                    x=q[g,kk*16+4*c:kk*16+4*c+4]; y=q[g+8,kk*16+4*c:kk*16+4*c+4]
                    ra.append([(x[0],x[1]),(y[0],y[1]),(x[2],x[3]),(y[2],y[3])])
                    v=tile[nt*8+perm8(g),kk*16+4*c:kk*16+4*c+4]
                    rb.append([(v[0],v[1]),(v[2],v[3])])
                res=mma(ra,rb,[s[ln][4*nt:4*nt+4] for ln in range(32)])
                for ln in range(32): s[ln][4*nt:4*nt+4]=res[ln]
        parts.append(s)
    S=[[sum(parts[k][ln][e] for k in range(4)) for e in range(8)] for ln in range(32)]
    alpha=[None]*32; P=[None]*32
    # softmax per lane (quad reductions)
    sc=[[0]*8 for _ in range(32)]
    for ln in range(32):
        g,c=ln//4,ln%4; p0=perm8(2*c); p1=perm8(2*c+1)
        for nt in range(2):
            v0=t0+nt*8+p0<L; v1=t0+nt*8+p1<L
            sc[ln][4*nt]=S[ln][4*nt]*scale if v0 else -1e30
            sc[ln][4*nt+1]=S[ln][4*nt+1]*scale if v1 else -1e30
            sc[ln][4*nt+2]=S[ln][4*nt+2]*scale if v0 else -1e30
            sc[ln][4*nt+3]=S[ln][4*nt+3]*scale if v1 else -1e30
    for ln in range(32):
        quad=[(ln//4)*4+k for k in range(4)]
        x0=max(max(sc[k][0],sc[k][1],sc[k][4],sc[k][5]) for k in quad)
        x1=max(max(sc[k][2],sc[k][3],sc[k][6],sc[k][7]) for k in quad)
        n0=max(m[ln][0],x0); n1=max(m[ln][1],x1)
        a0=np.exp(m[ln][0]-n0); a1=np.exp(m[ln][1]-n1); m[ln]=[n0,n1]
        p=[np.exp(sc[ln][e]-(n0 if e%4<2 else n1)) if sc[ln][e]>-1e29 else 0.0 for e in range(8)]
        l[ln]=[l[ln][0]*a0+p[0]+p[1]+p[4]+p[5], l[ln][1]*a1+p[2]+p[3]+p[6]+p[7]]
        alpha[ln]=(a0,a1); P[ln]=p
    for kw in range(4):
        vb=kw*r//4
        for jg in range(nj):
            for e in range(4):
                ra=[];rb=[]
                for ln in range(32):
                    g,c=ln//4,ln%4; p0=perm8(2*c); p1=perm8(2*c+1)
                    col=vb+32*jg+4*g+e
                    ra.append([(P[ln][0],P[ln][1]),(P[ln][2],P[ln][3]),(P[ln][4],P[ln][5]),(P[ln][6],P[ln][7])])
                    rb.append([(tile[p0,col],tile[p1,col]),(tile[8+p0,col],tile[8+p1,col])])
                tmp=mma(ra,rb,[[0]*4 for _ in range(32)])
                for ln in range(32):
                    at=(jg*4+e)*4; o=O[kw][ln]; a0,a1=alpha[ln]
                    o[at]=o[at]*a0+tmp[ln][0]; o[at+1]=o[at+1]*a0+tmp[ln][1]; o[at+2]=o[at+2]*a1+tmp[ln][2]; o[at+3]=o[at+3]*a1+tmp[ln][3]
# outputs
out=np.zeros((H,r))
for kw in range(4):
    vb=kw*r//4
    for ln in range(32):
        g,c=ln//4,ln%4
        L0=sum(l[(ln//4)*4+k][0] for k in range(4)); L1=sum(l[(ln//4)*4+k][1] for k in range(4))
        for jg in range(nj):
            for e in range(4):
                at=(jg*4+e)*4; o=O[kw][ln]
                v=vb+32*jg+8*c
                out[g,v+e]=o[at]/L0; out[g,v+4+e]=o[at+1]/L0; out[g+8,v+e]=o[at+2]/L1; out[g+8,v+4+e]=o[at+3]/L1
ref=np.zeros((H,r))
s=(q@lat.T)*scale
for h in range(H):
    w=np.exp(s[h]-s[h].max()); w/=w.sum(); ref[h]=w@lat[:,:r]
print("fragment mappings: max |emulated - reference|", np.abs(out-ref).max(), "of max", np.abs(ref).max())
assert np.abs(out-ref).max() < 1e-12


def split_exact(n=200000):
    """The kernel's split (`split_pair`): high part = the top 16 bits, then the remainder's twice: exact."""
    def u(x):
        return struct.unpack('<I', struct.pack('<f', x))[0]

    def f(b):
        return struct.unpack('<f', struct.pack('<I', b))[0]
    bad = 0
    for _ in range(n):
        x = f(u(random.uniform(-1, 1) * 10 ** random.uniform(-6, 3)))
        h = u(x) & 0xffff0000
        r = f(u(x - f(h)))
        m = u(r) & 0xffff0000
        r2 = f(u(r - f(m)))
        lo = u(r2) & 0xffff0000
        bad += f(h) + f(m) + f(lo) != x
    return bad


bad = split_exact()
print("split: inexact in", bad, "of 200000")
assert bad == 0


def positions_as_m(heads=8, length=45, scale=0.07):
    """The plan for few heads (docs/DEVELOPING.md, session 23 (7), not yet a kernel): positions as M. Scores S^T = K
    Q^T (A = 16 latent rows, B = the heads' queries), a head's softmax over lanes of equal c, P^T gathered from the
    score fragments by shuffles (lane (g, c) needs positions 2c, 2c + 1, 2c + 8, 2c + 9 of head g; value (p, h)
    sits in lane (p % 8) * 4 + h // 2, element (p // 8) * 2 + h % 2), then O^T = V^T P^T (M = 16 value dims)."""
    g_rng = np.random.default_rng(2)
    qh = g_rng.uniform(-1, 1, (heads, d))
    lt = g_rng.uniform(-1, 1, (length, d))
    ksteps = d // 16
    o_t = [[0.0] * (4 * (r // 16)) for _ in range(32)]  # m-tile j (dims 16j..): 4 floats a lane
    mh = [[-1e30, -1e30] for _ in range(32)]  # heads 2c, 2c + 1
    lh = [[0.0, 0.0] for _ in range(32)]
    for t0 in range(0, length, 16):
        tile = np.zeros((16, d))
        n = min(16, length - t0)
        tile[:n] = lt[t0:t0 + n]
        s = [[0.0] * 4 for _ in range(32)]
        for kk in range(ksteps):  # (4 warps would split these; their sums add in one order)
            ra, rb = [], []
            for lane in range(32):
                g, c = lane // 4, lane % 4
                x = tile[g, kk * 16 + 4 * c:kk * 16 + 4 * c + 4]
                y = tile[g + 8, kk * 16 + 4 * c:kk * 16 + 4 * c + 4]
                ra.append([(x[0], x[1]), (y[0], y[1]), (x[2], x[3]), (y[2], y[3])])
                qv = qh[g, kk * 16 + 4 * c:kk * 16 + 4 * c + 4] if g < heads else np.zeros(4)
                rb.append([(qv[0], qv[1]), (qv[2], qv[3])])
            s = mma(ra, rb, s)
        # C: lane (g, c) = (pos g, heads 2c, 2c + 1), (pos g + 8, the same).
        for lane in range(32):
            g = lane // 4
            for e in range(4):
                p = g + 8 * (e // 2)
                s[lane][e] = s[lane][e] * scale if t0 + p < length else -1e30
        p_t = [[0.0] * 4 for _ in range(32)]
        alpha = [None] * 32
        for lane in range(32):
            c = lane % 4
            same_c = [k * 4 + c for k in range(8)]  # shuffles xor 4, 8, 16
            new = []
            for e in range(2):
                mx = max(max(s[k][e], s[k][e + 2]) for k in same_c)
                new.append(max(mh[lane][e], mx))
            alpha[lane] = [np.exp(mh[lane][e] - new[e]) for e in range(2)]
            mh[lane] = new
        probs = [[np.exp(s[ln][e] - mh[ln][e % 2]) if s[ln][e] > -1e29 else 0.0 for e in range(4)] for ln in range(32)]
        for lane in range(32):
            lh[lane] = [lh[lane][e] * alpha[lane][e] + probs[lane][e] + probs[lane][e + 2] for e in range(2)]
        # P^T for B: lane (g, c) gathers (pos 2c, 2c + 1, 2c + 8, 2c + 9; head g) from the lanes that hold them.
        for lane in range(32):
            g, c = lane // 4, lane % 4
            for k, p in enumerate([2 * c, 2 * c + 1, 2 * c + 8, 2 * c + 9]):
                src = (p % 8) * 4 + g // 2
                p_t[lane][k] = probs[src][(p // 8) * 2 + g % 2]
        for j in range(r // 16):
            ra, rb = [], []
            for lane in range(32):
                g, c = lane // 4, lane % 4
                col = tile[:, 16 * j + g]
                col8 = tile[:, 16 * j + g + 8]
                ra.append([(col[2 * c], col[2 * c + 1]), (col8[2 * c], col8[2 * c + 1]),
                           (col[2 * c + 8], col[2 * c + 9]), (col8[2 * c + 8], col8[2 * c + 9])])
                rb.append([(p_t[lane][0], p_t[lane][1]), (p_t[lane][2], p_t[lane][3])])
            tmp = mma(ra, rb, [[0.0] * 4 for _ in range(32)])
            for lane in range(32):
                a0, a1 = alpha[lane]
                o = o_t[lane]
                o[4 * j] = o[4 * j] * a0 + tmp[lane][0]
                o[4 * j + 1] = o[4 * j + 1] * a1 + tmp[lane][1]
                o[4 * j + 2] = o[4 * j + 2] * a0 + tmp[lane][2]
                o[4 * j + 3] = o[4 * j + 3] * a1 + tmp[lane][3]
    out8 = np.zeros((heads, r))
    for lane in range(32):
        g, c = lane // 4, lane % 4
        tot = [sum(lh[k * 4 + c][e] for k in range(8)) for e in range(2)]
        for j in range(r // 16):
            for e in range(4):
                h = 2 * c + e % 2
                dim = 16 * j + g + 8 * (e // 2)
                if h < heads:
                    out8[h, dim] = o_t[lane][4 * j + e] / tot[e % 2]
    sc = (qh @ lt.T) * scale
    want = np.zeros((heads, r))
    for h in range(heads):
        w = np.exp(sc[h] - sc[h].max())
        want[h] = (w / w.sum()) @ lt[:, :r]
    return np.abs(out8 - want).max(), np.abs(want).max()


err8, big8 = positions_as_m()
print("positions as M (8 heads, the plan): max |emulated - reference|", err8, "of max", big8)
assert err8 < 1e-12
