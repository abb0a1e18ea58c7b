# input: quant.csv
# What each KV cache configuration costs in accuracy against what it
# saves in memory.  The f32 reference (KL 0, twice bf16's bytes) is the
# baseline, not a point.
load dir."/common.gp"
set title "Quantized KV cache: memory vs accuracy (lower left is better)"
set xlabel "KV bytes per token, relative to the bf16 cache"
set ylabel "mean KL divergence from the f32 cache (nats, log scale)"
set logscale y
set format y "10^{%L}"
set xrange [0:1.2]
set key top right
is(s) = strstrt(strcol("cache"), s) > 0
# quanto and hqq points of one bit width nearly coincide: their names go left and right of them
plot csv using "kv_bytes_vs_bf16":(is("quanto") ? column("mean_kl") : NaN) with points pt 7 ps 1.3 title "quanto", \
     csv using "kv_bytes_vs_bf16":(is("hqq") ? column("mean_kl") : NaN) with points pt 4 ps 1.6 title "hqq", \
     csv using "kv_bytes_vs_bf16":(is("quanto") || is("hqq") || is("f32") ? NaN : column("mean_kl")) with points pt 9 ps 1.5 title "bf16, fp8", \
     csv using "kv_bytes_vs_bf16":(is("quanto") ? column("mean_kl") : NaN):"cache" with labels offset -1,0 right font "sans,8" notitle noenhanced, \
     csv using "kv_bytes_vs_bf16":(is("quanto") || column("mean_kl") <= 0 ? NaN : column("mean_kl")):"cache" with labels offset 1,0 left font "sans,8" notitle noenhanced
