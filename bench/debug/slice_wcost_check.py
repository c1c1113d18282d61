"""A Python mirror of `decode_attention_gluon._slice` with WCOST > 0 (calibquant's slices shortened where a program
also takes exact-window tiles): checks that the programs' [start, stop) cover the quantized region exactly once,
with no gap or overlap, over slice counts, lengths, window tiles and weights (the kernel runs on a GPU only).

    python bench/debug/slice_wcost_check.py        (prints "bad 0")
"""
import itertools
def cdiv(a,b): return -(-a//b)
def sl(split, NSPLIT, qlen, BT, WCOST, NWIN, S=0):
    tiles = cdiv(qlen, BT)
    per = max(cdiv(tiles + WCOST*NWIN, NSPLIT), WCOST*cdiv(NWIN, NSPLIT))
    w_lo = NWIN//NSPLIT*split + min(split, NWIN % NSPLIT)
    w_hi = NWIN//NSPLIT*(split+1) + min(split+1, NWIN % NSPLIT)
    lo = split*per - WCOST*w_lo; hi = (split+1)*per - WCOST*w_hi
    start = S + min(lo, tiles)*BT; stop = min(S + min(hi, tiles)*BT, S + qlen)
    return start, stop
bad=0
for NSPLIT, qlen, W, E in itertools.product([1,2,3,7,8,16,200], [0,1,31,32,33,500,3968,65000], [0,1,4,5,9,10], [1,2,4,8]):
    cov=[]
    for i in range(NSPLIT):
        a,b=sl(i,NSPLIT,qlen,32,E,W)
        if b>a: cov.append((a,b))
    pos=0
    for a,b in cov:
        if a!=pos: bad+=1; print("gap/overlap", NSPLIT,qlen,W,E,cov[:5]); break
        pos=b
    if pos != qlen and qlen>0: bad+=1; print("end", NSPLIT,qlen,W,E,pos)
print("bad", bad)
