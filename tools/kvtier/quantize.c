/* quantize.c - `kvtier quantize`: a Hugging Face directory as a GGUF file
 * (model_gguf_write), for kvtierd --model FILE.gguf and llama.cpp alike.
 * The one command that works on files rather than through kvtierd. */
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include "model/model.h"
#include "tools/kvtier/cli.h"

const char cli_quantize_usage[] =
    "usage: kvtier quantize [--type q8_0|q4_k|bf16|f16|f32] MODEL_DIR OUT.gguf\n"
    "  Writes the safetensors model of MODEL_DIR as one GGUF file kvtierd --model loads.\n"
    "  q8_0 (the default): the layer matrices as Q8_0 blocks, what --weights q8_0 computes;\n"
    "  q4_k: Q4_K blocks where rows are whole 256-element super-blocks (else Q8_0), what\n"
    "  --weights q4_k computes.  The embeddings and lm_head keep their dtype under both.\n"
    "  bf16, f16, f32: every matrix converted.\n"
    "  Llama, Mistral (no sliding window), Qwen2, Qwen3, Gemma 2, Gemma 3, Phi-3 and GPT-2\n"
    "  with BPE tokenizers.\n";

int cmd_quantize(int argc, char **argv)
{
    enum model_gguf_type type = MODEL_GGUF_Q8_0;
    int i = 1;
    if (i + 1 < argc && !strcmp(argv[i], "--type")) {
        if (!model_gguf_type_parse(argv[i + 1], &type)) {
            fprintf(stderr, "kvtier quantize: --type %s (q8_0, q4_k, bf16, f16 or f32)\n", argv[i + 1]);
            return EXIT_USAGE;
        }
        i += 2;
    }
    if (argc - i != 2) {
        fputs(cli_quantize_usage, stderr);
        return EXIT_USAGE;
    }
    char err[MODEL_ERR_LEN];
    enum model_status st = model_gguf_write(argv[i], argv[i + 1], type, err);
    if (st != MODEL_OK) {
        fprintf(stderr, "kvtier quantize: %s: %s\n", model_strerror(st), err);
        return EXIT_DAEMON;
    }
    struct stat sb;
    if (stat(argv[i + 1], &sb) == 0)
        fprintf(stderr, "kvtier quantize: wrote %s (%.1f MiB)\n", argv[i + 1], (double)sb.st_size / 1048576.0);
    return 0;
}
