# input: quant.csv
# What each KV cache configuration costs in accuracy against what it
# saves in memory.  The f32 reference (KL 0) is off the log scale.
load dir."/common.gp"
set title "Quantized KV cache: memory vs accuracy (lower left is better)"
set xlabel "KV bytes per token, relative to the bf16 cache"
set ylabel "mean KL divergence from the f32 cache (nats, log scale)"
set logscale y
set format y "10^{%L}"
set xrange [0:*]
set key top right
is(s) = strstrt(strcol("cache"), s) > 0
plot csv using "kv_bytes_vs_bf16":(is("quanto") ? column("mean_kl") : NaN) with points pt 7 ps 1.3 title "quanto", \
     csv using "kv_bytes_vs_bf16":(is("hqq") ? column("mean_kl") : NaN) with points pt 5 ps 1.3 title "hqq", \
     csv using "kv_bytes_vs_bf16":(is("quanto") || is("hqq") || is("f32") ? NaN : column("mean_kl")) with points pt 9 ps 1.5 title "bf16, fp8", \
     csv using "kv_bytes_vs_bf16":(column("mean_kl") > 0 ? column("mean_kl") : NaN):"cache" with labels offset 0.8,0.6 left font "sans,8" notitle noenhanced
