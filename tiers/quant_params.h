/* quant_params.h - the "quantized" cache strategy's parameters, apart from
 * the rest of quant.h so that kvstore.h's kv_seq_params can carry them by
 * value (quant.h itself needs kvstore.h's tier_status). */
#ifndef KVTIER_QUANT_PARAMS_H
#define KVTIER_QUANT_PARAMS_H

enum kv_quant_backend { KVQ_QUANTO = 0, KVQ_HQQ = 1, KVQ_FP8 = 2 };

/* The reference's QuantizedCache arguments.  axis_* are in the backend's own
 * numbering (quanto 0 = per token, -1 = per channel; hqq 1 = per token,
 * 0 = per channel).  fp8 uses none of the other fields. */
struct kv_quant_params {
    enum kv_quant_backend backend;
    int nbits;
    int axis_key, axis_value;
    int q_group_size;
    int residual_length;
};

#endif
