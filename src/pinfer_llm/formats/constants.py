"""Every GGUF key and tensor-name template pinfer reads or writes, in one place.

Standard llama.cpp names come first, then PowerInfer's additions (as its convert.py writes them), then pinfer's own.
Templates take the block index as `bid`: TENSOR.ffn_up.format(bid=3) -> "blk.3.ffn_up.weight".
"""

# --- file magics -------------------------------------------------------------------------------------------------
GGUF_MAGIC = b"GGUF"
PWRI_MAGIC = b"PWRI"  # PowerInfer: a GGUF v3 file whose first four bytes are overwritten
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# --- ggml type ids ------------------------------------------------------------------------------------------------
# Tensor type ids of PowerInfer's ggml (its ggml.h: enum ggml_type, GGML_TYPE_COUNT = 19) -> the same type in the
# `gguf` package's numbering (today's ggml). They agree up to Q8_K; PowerInfer then has I8/I16/I32 = 16/17/18, which
# today's ggml numbers 24/25/26 (its 16-18 are IQ2_XXS/IQ2_XS/IQ3_XXS). 4 and 5 (Q4_2/Q4_3, removed) and every id >= 19
# mean nothing to PowerInfer: its loader divides by their block size, which is 0 (SIGFPE). Files with the PWRI magic
# (models and .gpuidx) use these ids; everything else, pinfer's own section included, uses the gguf package's.
POWERINFER_TYPE_IDS = {0: 0, 1: 1, 2: 2, 3: 3, 6: 6, 7: 7, 8: 8, 9: 9, 10: 10, 11: 11, 12: 12, 13: 13, 14: 14, 15: 15,
                       16: 24, 17: 25, 18: 26}
POWERINFER_TYPE_COUNT = 19

# --- pinfer's section ---------------------------------------------------------------------------------------------
# Everything pinfer adds to an existing model lives after the model's tensor data, where no other loader looks (see
# formats/section.py for the layout): a directory block at the first page boundary after the data, then sections,
# each a GGUF v3 blob of its own (standard type ids). The model's header and data are never changed in place.
SECTION_PAGE = 4096  # directory and sections start on page boundaries
SECTION_DIR_MAGIC = b"PINFERSD"
SECTION_DIR_VERSION = 1
SECTION_DIR_SIZE = SECTION_PAGE
# Below this a section tensor is copied into every new section, covered by the checksum and read with pread.
SECTION_SMALL_TENSOR = 1 << 20
SECTION_VERSION = "pinfer.section.version"  # u32 (1)
SECTION_HIDDEN_KEYS = "pinfer.section.hidden_keys"  # str array: header keys the section deletes
SECTION_HIDDEN_TENSORS = "pinfer.section.hidden_tensors"  # str array: header tensors the section deletes
SECTION_TENSOR_OFFSETS = "pinfer.section.tensor_offsets"  # u64 array [n_tensors]: absolute file offset of each
SECTION_KEYS = (SECTION_VERSION, SECTION_HIDDEN_KEYS, SECTION_HIDDEN_TENSORS, SECTION_TENSOR_OFFSETS)

# --- general metadata --------------------------------------------------------------------------------------------
ARCHITECTURE = "general.architecture"
NAME = "general.name"
ALIGNMENT = "general.alignment"
FILE_TYPE = "general.file_type"

# Architecture-scoped keys are written "{arch}.…"; format them with arch=...
CONTEXT_LENGTH = "{arch}.context_length"
EMBEDDING_LENGTH = "{arch}.embedding_length"
BLOCK_COUNT = "{arch}.block_count"
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
HEAD_COUNT = "{arch}.attention.head_count"
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
LAYER_NORM_EPS = "{arch}.attention.layer_norm_epsilon"  # LayerNorm archs (falcon; opt files may omit it)
KEY_LENGTH = "{arch}.attention.key_length"
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
ROPE_FREQ_BASE = "{arch}.rope.freq_base"
ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"  # older files
VOCAB_SIZE = "{arch}.vocab_size"
TENSOR_DATA_LAYOUT = "{arch}.tensor_data_layout"  # falcon: "jploski" = attn_qkv rows as [all q | all k | all v]

# --- tokenizer ----------------------------------------------------------------------------------------------------
TOKENIZER_MODEL = "tokenizer.ggml.model"  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
TOKENIZER_PRE = "tokenizer.ggml.pre"
TOKENIZER_TOKENS = "tokenizer.ggml.tokens"
TOKENIZER_SCORES = "tokenizer.ggml.scores"
TOKENIZER_TOKEN_TYPE = "tokenizer.ggml.token_type"
TOKENIZER_MERGES = "tokenizer.ggml.merges"
TOKENIZER_BOS_ID = "tokenizer.ggml.bos_token_id"
TOKENIZER_EOS_ID = "tokenizer.ggml.eos_token_id"
TOKENIZER_UNK_ID = "tokenizer.ggml.unknown_token_id"
TOKENIZER_EOT_ID = "tokenizer.ggml.eot_token_id"
TOKENIZER_ADD_BOS = "tokenizer.ggml.add_bos_token"
TOKENIZER_ADD_EOS = "tokenizer.ggml.add_eos_token"
TOKENIZER_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
TOKENIZER_CHAT_TEMPLATE = "tokenizer.chat_template"

# llama.cpp token types (tokenizer.ggml.token_type)
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# --- tensors (llama layout) ---------------------------------------------------------------------------------------
TOKEN_EMBD = "token_embd.weight"
OUTPUT_NORM = "output_norm.weight"
OUTPUT = "output.weight"  # absent -> tied to token_embd
ATTN_NORM = "blk.{bid}.attn_norm.weight"
ATTN_Q = "blk.{bid}.attn_q.weight"
ATTN_K = "blk.{bid}.attn_k.weight"
ATTN_V = "blk.{bid}.attn_v.weight"
ATTN_OUT = "blk.{bid}.attn_output.weight"
FFN_NORM = "blk.{bid}.ffn_norm.weight"
FFN_GATE = "blk.{bid}.ffn_gate.weight"
FFN_UP = "blk.{bid}.ffn_up.weight"
FFN_DOWN = "blk.{bid}.ffn_down.weight"

# --- tensors of the LayerNorm families (falcon, opt): biases, fused QKV, a second norm, learned positions ----------
POS_EMBD = "position_embd.weight"  # opt: learned absolute positions, row p + OPT_POS_OFFSET for position p
OUTPUT_NORM_B = "output_norm.bias"
ATTN_NORM_B = "blk.{bid}.attn_norm.bias"
ATTN_NORM_2 = "blk.{bid}.attn_norm_2.weight"  # falcon 40B layout: HF's ln_attn (attention input); attn_norm = ln_mlp
ATTN_NORM_2_B = "blk.{bid}.attn_norm_2.bias"
ATTN_QKV = "blk.{bid}.attn_qkv.weight"  # falcon: [(n_head + 2 n_head_kv) * head_dim, n_embd], [all q | all k | all v]
ATTN_QKV_B = "blk.{bid}.attn_qkv.bias"
ATTN_Q_B = "blk.{bid}.attn_q.bias"
ATTN_K_B = "blk.{bid}.attn_k.bias"
ATTN_V_B = "blk.{bid}.attn_v.bias"
ATTN_OUT_B = "blk.{bid}.attn_output.bias"
FFN_NORM_B = "blk.{bid}.ffn_norm.bias"
FFN_UP_B = "blk.{bid}.ffn_up.bias"  # [n_ff]: one per neuron (opt)
FFN_DOWN_B = "blk.{bid}.ffn_down.bias"  # [n_embd]: added to the FFN's output
OPT_POS_OFFSET = 2  # HF's OPTLearnedPositionalEmbedding: position p reads row p + 2

# --- PowerInfer additions ------------------------------------------------------------------------------------------
FFN_DOWN_T = "blk.{bid}.ffn_down_t.weight"  # W_down transposed: row i = neuron i's output column
FFN_DOWN_T_B = "blk.{bid}.ffn_down_t.bias"  # PowerInfer's converter renames ffn_down.bias along with the weight (opt)
PRED_FC1 = "blk.{bid}.fc1.weight"  # predictor Linear(n_embd -> r), ggml ne [n_embd, r]
PRED_FC2 = "blk.{bid}.fc2.weight"  # predictor Linear(r -> n_ff), ggml ne [r, n_ff]
SPARSE_THRESHOLD = "powerinfer.sparse_threshold"  # neuron i active iff fc2(relu(fc1 x))[i] >= threshold
GPU_IDX = "blk.{bid}.gpu_idx"  # I32 [n_ff], 1 where the neuron lives on the GPU
GPU_BUCKET = "blk.{bid}.gpu_bucket"  # I32 [k], sorted original indices of GPU neurons
GPU_INDEX_ARCH = "generic.gpu_index"  # general.architecture of a .generated.gpuidx file
GPU_INDEX_BLOCK_COUNT = "generic.gpu_index.block_count"
SPLIT_VRAM_CAPACITY = "split.vram_capacity"  # u64 bytes the placement was solved for
GPUIDX_SUFFIX = ".generated.gpuidx"
ACTIVATION_FILE = "activation_{bid}.pt"

# Tensors only pinfer reads. In a model's header they break other loaders (PowerInfer: "basic_string: construction
# from null is not valid"; llama.cpp: "wrong number of tensors"), so pinfer stores them in its section. Earlier pinfer
# versions put them in headers: such files are still read; a copy written with -o moves them to the section.
PINFER_ONLY_TENSORS = ("blk.{bid}.act_counts", "blk.{bid}.act_peak", "blk.{bid}.gpu_idx", "blk.{bid}.gpu_bucket")

# --- pinfer additions ---------------------------------------------------------------------------------------------
# The FFN activation is decided from the file (see config.py); this key lets a file state it outright.
FFN_ACTIVATION = "pinfer.ffn_activation"  # "silu" | "relu" | "drelu"; gate-less archs: "relu" | "gelu"

# Activation statistics written by pi-profile (documented in docs/profiling.md, "What is stored").
ACT_COUNTS = "blk.{bid}.act_counts"  # F32 [n_ff]: tokens on which neuron i was active
ACT_TOKENS = "pinfer.activation.tokens"  # u64: tokens profiled (frequency = counts / tokens)
ACT_CORPUS = "pinfer.activation.corpus"  # str: corpus description
ACT_DATE = "pinfer.activation.date"  # str: ISO-8601 date of the profile
ACT_RULE = "pinfer.activation.rule"  # str: "relu>0" or "|silu(gate)|>thr"
# CATS-style thresholds for SwiGLU models (--sparsity): neuron active iff |silu(gate)| > threshold[layer]
CATS_THRESHOLD = "pinfer.cats.threshold"  # f32 array [n_layer]
CATS_SPARSITY = "pinfer.cats.sparsity"  # f32 target sparsity used to calibrate them

# Placement plans written by pi-plan (in addition to PowerInfer's gpu_idx/gpu_bucket tensors).
PLAN_PREFIX = "pinfer.plan."
PLAN_GPUS = "pinfer.plan.gpus"  # str array
PLAN_VRAM_BUDGET = "pinfer.plan.vram_budget"  # u64 bytes
PLAN_CTX = "pinfer.plan.ctx_size"
PLAN_OBJECTIVE = "pinfer.plan.objective"
PLAN_TOKENS_PER_S = "pinfer.plan.predicted_tokens_per_s"
PLAN_STATUS = "pinfer.plan.solver_status"
PLAN_GAP = "pinfer.plan.gap"
PLAN_FINGERPRINT = "pinfer.plan.fingerprint"  # hash of tensor names, shapes and types
PLAN_ATTN_GPU = "pinfer.plan.attn_gpu"  # u8 array [n_layer]: attention block on GPU
PLAN_PRED_GPU = "pinfer.plan.pred_gpu"  # u8 array [n_layer]: predictor on GPU


def tensor(template: str, bid: int) -> str:
    return template.format(bid=bid)


def arch_key(template: str, arch: str) -> str:
    return template.format(arch=arch)

# synth
# Synthetic models with planted activation locality (synth/). Stored as metadata, not tensors, so that a
# llama loader finds exactly the tensors it expects.
SYNTH_TARGET_FREQ = "pinfer.synth.target_freq.{bid}"  # f32 array [n_ff]: planted P(neuron i active) in block bid
SYNTH_SEED = "pinfer.synth.seed"  # u32
SYNTH_SPARSITY = "pinfer.synth.sparsity"  # f32: planted mean fraction of inactive neurons per token
SYNTH_SKEW = "pinfer.synth.skew"  # f32: power-law exponent of frequency over neuron rank
SYNTH_GATE_RANK = "pinfer.synth.gate_rank"  # u32: rank of the gate rows' shared subspace (0: isotropic)
SYNTH_GATE_NOISE = "pinfer.synth.gate_noise"  # f32: share of gate-row variance outside it
SYNTH_CALIB_TOKENS = "pinfer.synth.calib_tokens"  # u32: random tokens each layer was calibrated on
SYNTH_TOP1_PROB = "pinfer.synth.top1_prob"  # f32: mean top-1 next-token probability on the calibration batch

# planner
# pi-plan's own plan keys (beside the PLAN_* keys above). Device codes in the u8 arrays: 0 = CPU, k = GPU k (1-based,
# in the order of pinfer.plan.gpus), so "nonzero" still reads as "on a GPU".
PLAN_FFN_GPU = "pinfer.plan.ffn_gpu"  # u8 array [n_layer]: GPU holding the layer's GPU neurons (0: none)
PLAN_GPU_NEURONS = "pinfer.plan.gpu_neurons"  # u32 array [n_layer]: neurons on the GPU (the hottest ones)
PLAN_SPLIT = "pinfer.plan.split"  # u8 array [n_layer]: 1 where the layer runs on both a GPU and the CPU
PLAN_OUTPUT_GPU = "pinfer.plan.output_gpu"  # u8: device of the output head
PLAN_VRAM_USED = "pinfer.plan.vram_used"  # u64 array [n_gpus]: bytes by the planner's accounting
PLAN_GROUP = "pinfer.plan.group"  # u32: neuron group size of the solve
PLAN_SOLVER = "pinfer.plan.solver"  # str: "cbc" | "highs"
PLAN_SOLVE_SECONDS = "pinfer.plan.solve_seconds"  # f32
PLAN_HARDWARE = "pinfer.plan.hardware"  # str: JSON of the hardware description the plan was made for
PLAN_BASELINES = "pinfer.plan.baselines"  # str: JSON {baseline: predicted tokens/s or null}
PLAN_GPUIDX = "pinfer.plan.gpuidx_fingerprint"  # str: placement_fingerprint of the .gpuidx exported with the plan
PLAN_VERSION = "pinfer.plan.version"  # u32: layout version of these keys (1)

# Skeleton GGUF: metadata and activation statistics only. Weight tensors are declared in metadata instead of being
# stored, so the file stays a few MB and standard GGUF readers still open it. The planner reads shapes through
# planner.memory.tensor_table, which merges these declarations with the real tensor infos.
SKELETON = "pinfer.skeleton"  # bool: true in a skeleton file
SKELETON_SHAPE = "pinfer.skeleton.shape"  # str: the known shape it was made from ("llama2-70b")
SKELETON_TENSOR_NAMES = "pinfer.skeleton.tensor_names"  # str array [n]
SKELETON_TENSOR_TYPES = "pinfer.skeleton.tensor_types"  # u32 array [n]: GGMLQuantizationType
SKELETON_TENSOR_N_DIMS = "pinfer.skeleton.tensor_n_dims"  # u32 array [n]
SKELETON_TENSOR_NE = "pinfer.skeleton.tensor_ne"  # u64 array [4 n]: ggml ne, padded with 1 to four dims

# profile
# Predictors written by pi-profile --train-predictors, beside PowerInfer's blk.N.fc1/fc2 and its sparse_threshold.
# Per-layer thresholds, when present, replace powerinfer.sparse_threshold; pi-profile writes them only when one global
# threshold cannot serve every layer (it normally rescales fc2 so that one does).
PRED_THRESHOLDS = "pinfer.predictor.threshold"  # f32 [n_layer]
PRED_RECALL = "pinfer.predictor.recall"  # f32 [n_layer]: recall of the stored predictors on held-out profiled tokens
PRED_PRECISION = "pinfer.predictor.precision"  # f32 [n_layer]: precision on the same tokens
PRED_RECALL_TARGET = "pinfer.predictor.recall_target"  # f32: the --recall the thresholds were set for
PRED_SOURCE = "pinfer.predictor.source"  # str: "pi-profile" (trained) or "imported: DIR"
# Largest |activation| each neuron reached while profiling. SwiGLU models have a few "massive activation" neurons
# (e.g. on the first token) that carry hundreds of times the usual magnitude; missing one ruins a whole sequence, so
# the runtime computes such outliers for every token whatever the predictor says (runtime/ffn/sparse.py).
ACT_PEAK = "blk.{bid}.act_peak"  # F32 [n_ff]
