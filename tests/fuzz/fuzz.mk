# fuzz.mk - coverage-guided fuzzing of every parser that takes outside bytes
# (included by the Makefile).  The library is rebuilt with clang into
# build/fuzz/ with libFuzzer's coverage and ASan + UBSan; each harness
# tests/fuzz/fuzz_<name>.c links against it.
#
#   make fuzz                    every harness for FUZZ_SECONDS (default 60) EACH
#   make fuzz FUZZ_SECONDS=600   ten minutes each
#   make fuzz FUZZ_ONLY="request chat"   a subset
#   make fuzz-ci                 the committed corpus as regression inputs, then
#                                FUZZ_CI_SECONDS (default 8) of fuzzing each
#                                (about a minute for all of them)
#
# Corpora: tests/fuzz/<name>/seed (committed, minimised) and
# tests/fuzz/<name>/regress (inputs that once crashed) are read; new inputs
# go to build/fuzz/corpus/<name>, crashes to build/fuzz/crash/<name>-*.
# A harness fails (exit non-zero) on a sanitizer report, a broken invariant
# (abort), a timeout, or a single allocation over FUZZ_MALLOC_MB.

FUZZ_CC      ?= clang
FUZZ_BUILD   := build/fuzz
FUZZ_SECONDS ?= 60
FUZZ_CI_SECONDS ?= 8
FUZZ_MALLOC_MB ?= 512
FUZZ_NICE    ?=
FUZZ_NAMES   := $(patsubst tests/fuzz/fuzz_%.c,%,$(wildcard tests/fuzz/fuzz_*.c))
FUZZ_ONLY    ?= $(FUZZ_NAMES)
FUZZ_SAN     := -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
FUZZ_CFLAGS  := -std=c11 -g -O1 -Wall -Wextra -Wno-unused-parameter -fPIC -pthread $(FUZZ_SAN)
FUZZ_LIB     := $(FUZZ_BUILD)/libkvtier.a
# The CPU kernels and the read-bandwidth probe are left out: no parser
# reaches them, their SIMD files need their own target flags, and clang 14
# lacks some of gcc's __builtin_cpu_supports names.
FUZZ_LIB_SRC := $(filter-out backend/cpu/% util/readbw%,$(LIB_SRC))
FUZZ_LIB_OBJ := $(FUZZ_LIB_SRC:%.c=$(FUZZ_BUILD)/obj/%.o)
FUZZ_BINS    := $(FUZZ_NAMES:%=$(FUZZ_BUILD)/fuzz_%)
# libFuzzer options every run shares: a slow input is a finding too.
FUZZ_OPTS    := -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=$(FUZZ_MALLOC_MB) -print_final_stats=1

.PHONY: fuzz fuzz-ci fuzz-build deps-fuzz

deps-fuzz:
	@tools/deps.sh test

$(FUZZ_LIB_OBJ): | deps-fuzz

$(FUZZ_BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(FUZZ_CC) $(CPPFLAGS) $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link -c $< -o $@

$(FUZZ_LIB): $(FUZZ_LIB_OBJ)
	rm -f $@ && ar rcs $@ $^

$(FUZZ_BUILD)/fuzz_%: $(FUZZ_BUILD)/obj/tests/fuzz/fuzz_%.o $(FUZZ_BUILD)/obj/tests/fuzz/no_cpu.o $(FUZZ_LIB)
	$(FUZZ_CC) $(FUZZ_SAN) -fsanitize=fuzzer $^ -o $@ $(LDLIBS)

fuzz-build: $(FUZZ_BINS)

# run-one NAME SECONDS: the committed inputs first (each must pass), then
# fuzzing for SECONDS with the seeds and the dictionary.
define fuzz_run
	@mkdir -p $(FUZZ_BUILD)/corpus/$(1) $(FUZZ_BUILD)/crash
	@echo "== fuzz $(1): regression inputs"
	@$(FUZZ_NICE) $(FUZZ_BUILD)/fuzz_$(1) $(FUZZ_OPTS) -runs=0 tests/fuzz/$(1)/seed $(wildcard tests/fuzz/$(1)/regress) \
	    > $(FUZZ_BUILD)/$(1).regress.log 2>&1 || { tail -n 60 $(FUZZ_BUILD)/$(1).regress.log; exit 1; }
	@echo "== fuzz $(1): $(2) s"
	@$(FUZZ_NICE) $(FUZZ_BUILD)/fuzz_$(1) $(FUZZ_OPTS) -max_total_time=$(2) \
	    -artifact_prefix=$(FUZZ_BUILD)/crash/$(1)- \
	    $(if $(wildcard tests/fuzz/$(1)/dict),-dict=tests/fuzz/$(1)/dict) \
	    $(FUZZ_BUILD)/corpus/$(1) tests/fuzz/$(1)/seed $(wildcard tests/fuzz/$(1)/regress) \
	    > $(FUZZ_BUILD)/$(1).log 2>&1 || { tail -n 60 $(FUZZ_BUILD)/$(1).log; exit 1; }
	@grep -E '^stat::number_of_executed_units|^stat::peak_rss_mb|^#[0-9]+.*DONE' $(FUZZ_BUILD)/$(1).log | tr '\n' ' '; echo

endef

fuzz: $(FUZZ_ONLY:%=$(FUZZ_BUILD)/fuzz_%)
	$(foreach h,$(FUZZ_ONLY),$(call fuzz_run,$(h),$(FUZZ_SECONDS)))

fuzz-ci: $(FUZZ_ONLY:%=$(FUZZ_BUILD)/fuzz_%)
	$(foreach h,$(FUZZ_ONLY),$(call fuzz_run,$(h),$(FUZZ_CI_SECONDS)))

-include $(shell find $(FUZZ_BUILD)/obj -name '*.d' 2>/dev/null)
