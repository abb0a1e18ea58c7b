# kvtier - plain GNU Make.  `make` builds, `make test` builds and runs every
# test, `make SANITIZE=1 test` reruns them under ASan+UBSan, `make run`
# starts kvtierd on the built-in model, `make CUDA=1` adds the CUDA plugin.
# Missing Debian packages are installed by tools/deps.sh (as root).

CC      ?= gcc
NVCC    ?= /usr/local/cuda/bin/nvcc
BUILD   ?= build
SANITIZE ?= 0
CUDA    ?= 0

CFLAGS  := -std=c11 -g -O2 -Wall -Wextra -Werror -Wstrict-prototypes -Wshadow -fPIC -pthread
CPPFLAGS := -D_GNU_SOURCE -MMD -MP -I.
LDLIBS  := -lhiredis -lhwloc -ljansson -lpcre2-8 -lxxhash -lmicrohttpd -luring -lzstd -lopenblas -ldl -lm -pthread
TESTLIBS := -lcmocka

ifeq ($(SANITIZE),1)
  BUILD   := build/asan
  CFLAGS  := $(filter-out -O2,$(CFLAGS)) -O1 -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined
  LDFLAGS += -fsanitize=address,undefined
endif

# SIMD variants are separate files compiled with their own flags and chosen
# at run time (backend/cpu/dispatch), so one binary runs on every x86-64.
AVX2_FLAGS   := -mavx2 -mfma -mf16c
AVX512_FLAGS := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512bf16 -mfma -mf16c

LIB_SRC    := $(wildcard util/*.c text/*.c backend/*.c backend/cpu/*.c tiers/*.c model/*.c ipc/*.c)
DAEMON_SRC := $(wildcard daemon/*.c)
TOOL_SRC   := $(wildcard tools/*.c)
TEST_SRC   := $(wildcard tests/test_*.c)

LIB      := $(BUILD)/libkvtier.a
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
DAEMON   := $(if $(DAEMON_SRC),$(BUILD)/kvtierd)
TOOLS    := $(TOOL_SRC:tools/%.c=$(BUILD)/%)
TESTS    := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)

.PHONY: all deps deps-test test soak check-sanitize run bench clean cuda
# Objects are intermediates of the pattern rules; keep them so a second
# `make test` rebuilds nothing.
.SECONDARY:
all: deps $(LIB) $(DAEMON) $(TOOLS) $(if $(filter 1,$(CUDA)),cuda)

deps:
	@tools/deps.sh build

# Headers come from the packages deps installs, so nothing compiles before
# it has run (make -j would otherwise race the install on a fresh machine).
$(LIB_OBJ) $(DAEMON_SRC:%.c=$(BUILD)/obj/%.o) $(TOOL_SRC:%.c=$(BUILD)/obj/%.o): | deps
$(TEST_SRC:%.c=$(BUILD)/obj/%.o): | deps-test

deps-test:
	@tools/deps.sh test

$(BUILD)/obj/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(AVX2_FLAGS) -c $< -o $@

$(BUILD)/obj/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(AVX512_FLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/kvtierd: $(DAEMON_SRC:%.c=$(BUILD)/obj/%.o) $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/%: $(BUILD)/obj/tools/%.o $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(TESTLIBS)

# A CUDA backend is a plugin (build/libkvtier-cuda.so) that be_open("cuda")
# loads with dlopen, so the core never links against CUDA.  No CUDA backend
# is written yet: the switch says so instead of calling nvcc on nothing.
CUDA_SRC := $(wildcard backend/cuda/*.cu)
ifeq ($(CUDA_SRC),)
cuda:
	@echo "make CUDA=1: no CUDA backend sources yet (backend/cuda/*.cu); the plugin seam is backend/backend_impl.h" >&2; exit 1
else
cuda: $(BUILD)/libkvtier-cuda.so
$(BUILD)/libkvtier-cuda.so: $(CUDA_SRC) $(wildcard backend/cuda/*.h) backend/backend_impl.h
	@mkdir -p $(dir $@)
	$(NVCC) -O2 -std=c++17 -shared -Xcompiler -fPIC -I. $(CUDA_SRC) -o $@ -lcublas -lcudart
endif

# Quick tier: every test binary plus the oracle tests, each under a timeout.
test: all deps-test $(TESTS)
	@tests/run.sh $(BUILD)

# The soak test (tests/daemon_soak.py): kvtierd under mixed load, its RSS,
# fds and threads checked against the warm-up's; 15 minutes unless told.
KVTIER_SOAK_SECONDS ?= 900
soak: all
	KVTIER_BUILD=$(BUILD) KVTIER_SOAK_SECONDS=$(KVTIER_SOAK_SECONDS) /usr/bin/python3 tests/daemon_soak.py

# The sanitizer run CI performs.
check-sanitize:
	$(MAKE) SANITIZE=1 test

run: all
	@tools/run.sh $(BUILD)

bench: all
	@echo "see docs/benchmarks.md for the benchmark commands"

clean:
	rm -rf build

# make fuzz / make fuzz-ci: libFuzzer harnesses (tests/fuzz/fuzz.mk says how).
include tests/fuzz/fuzz.mk

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
