import re,sys,statistics as st,collections
d=sys.argv[1] if len(sys.argv)>1 else '/tmp/bench2'
for name in ['1x4','2x1']:
    vals=collections.defaultdict(list)
    v=None
    for l in open(f'{d}/out-{name}.txt'):
        m=re.match(r'== round (\d+) (\w+)',l)
        if m: v=m.group(2); continue
        m=re.match(r'\s+([\w-]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)',l)
        if m and v: vals[(m.group(1),int(m.group(2)),v)].append(float(m.group(5)))
    keys=sorted({(k[0],k[1]) for k in vals})
    print(f'# {name} busbw GB/s median over runs (n)')
    for op,b in keys:
        o=vals[(op,b,'old')]; n=vals[(op,b,'new')]
        if o and n: print(f'{name} {op:15s} {b>>20:3d}M old {st.median(o):6.3f} new {st.median(n):6.3f} ratio {st.median(n)/st.median(o):5.2f} (n={len(o)},{len(n)})')
vals=collections.defaultdict(list); key=None
for l in open(f'{d}/out-overhead.txt'):
    m=re.match(r'== round (\d+) (\w+) overhead ([\w-]+)',l)
    if m: key=(m.group(3),m.group(2)); continue
    m=re.match(r'\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)',l)
    if m and key: vals[key].append(float(m.group(3)))
for (model,v),r in sorted(vals.items()): print(f'overhead {model} {v}: median ratio {st.median(r):.3f} runs {r}')
