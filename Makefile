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
LDLIBS  := -lhiredis -lhwloc -ljansson -lpcre2-8 -lxxhash -lmicrohttpd -luring -lzstd -lopenblas -lutf8proc -ldl -lm -pthread
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
VNNI_FLAGS   := $(AVX512_FLAGS) -mavx512vnni

LIB_SRC    := $(wildcard util/*.c text/*.c backend/*.c backend/cpu/*.c tiers/*.c model/*.c ipc/*.c)
DAEMON_SRC := $(wildcard daemon/*.c)
TOOL_SRC   := $(wildcard tools/*.c)
TEST_SRC   := $(wildcard tests/test_*.c)

LIB      := $(BUILD)/libkvtier.a
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/obj/%.o)
DAEMON   := $(if $(DAEMON_SRC),$(BUILD)/kvtierd)
TOOLS    := $(TOOL_SRC:tools/%.c=$(BUILD)/%)
TESTS    := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)

# libkvtier-client (client/): the C client library, static and shared
# (soname libkvtier-client.so.1), with the one ipc file it needs (the
# socket-path rule) inside it; public header client/kvtier/client.h.
CLIENT_SRC    := $(wildcard client/*.c) ipc/sockpath.c ipc/status.c
CLIENT_OBJ    := $(CLIENT_SRC:%.c=$(BUILD)/obj/%.o)
CLIENT_LIB    := $(BUILD)/libkvtier-client.a
CLIENT_SONAME := libkvtier-client.so.1
CLIENT_SO     := $(BUILD)/libkvtier-client.so
CLIENT_LDLIBS := -lcurl -ljansson -pthread
# the kvtier CLI's own files beside tools/kvtier.c (chat, top)
CLI_OBJ       := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard tools/kvtier/*.c))

.PHONY: all deps deps-test test soak check-sanitize run bench clean cuda install uninstall FORCE
# Objects are intermediates of the pattern rules; keep them so a second
# `make test` rebuilds nothing.
.SECONDARY:
all: deps $(LIB) $(CLIENT_LIB) $(CLIENT_SO) $(DAEMON) $(TOOLS) $(if $(filter 1,$(CUDA)),cuda)

deps:
	@tools/deps.sh build

# Headers come from the packages deps installs, so nothing compiles before
# it has run (make -j would otherwise race the install on a fresh machine).
$(LIB_OBJ) $(DAEMON_SRC:%.c=$(BUILD)/obj/%.o) $(TOOL_SRC:%.c=$(BUILD)/obj/%.o) $(CLIENT_OBJ) $(CLI_OBJ): | deps
$(TEST_SRC:%.c=$(BUILD)/obj/%.o): | deps-test

deps-test:
	@tools/deps.sh test

# One version string for every binary (util/version.h): the VERSION file,
# and `git describe` when built from a git tree.  The stamp is rewritten
# only when the string changes, so an unchanged tree relinks nothing.
KVTIER_RELEASE := $(shell cat VERSION)
GIT_DESCRIBE   := $(shell git describe --tags --always --dirty 2>/dev/null)
KVTIER_VERSION := $(KVTIER_RELEASE)$(if $(GIT_DESCRIBE), (git $(GIT_DESCRIBE)))
VERSION_STAMP  := $(BUILD)/version.txt
$(VERSION_STAMP): FORCE
	@mkdir -p $(dir $@)
	@echo '$(KVTIER_VERSION)' > $@.tmp
	@if cmp -s $@.tmp $@; then rm $@.tmp; else mv $@.tmp $@; fi
$(BUILD)/obj/util/version.o: $(VERSION_STAMP)
$(BUILD)/obj/util/version.o: CPPFLAGS += -DKVTIER_VERSION='"$(KVTIER_VERSION)"'
FORCE:

$(BUILD)/obj/%_avx2.o: %_avx2.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(AVX2_FLAGS) -c $< -o $@

$(BUILD)/obj/%_avx512.o: %_avx512.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(AVX512_FLAGS) -c $< -o $@

$(BUILD)/obj/%_vnni.o: %_vnni.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) $(VNNI_FLAGS) -c $< -o $@

$(BUILD)/obj/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CPPFLAGS) $(CFLAGS) -c $< -o $@

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(CLIENT_LIB): $(CLIENT_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BUILD)/$(CLIENT_SONAME): $(CLIENT_OBJ) client/libkvtier-client.map
	$(CC) $(LDFLAGS) -shared -Wl,-z,defs -Wl,-soname,$(CLIENT_SONAME) -Wl,--version-script=client/libkvtier-client.map \
		$(CLIENT_OBJ) -o $@ $(CLIENT_LDLIBS)

$(CLIENT_SO): $(BUILD)/$(CLIENT_SONAME)
	ln -sf $(CLIENT_SONAME) $@

$(BUILD)/kvtier: $(BUILD)/obj/tools/kvtier.o $(CLI_OBJ) $(CLIENT_LIB) $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(CLIENT_LDLIBS) -ledit -lncursesw

# programs that talk to kvtierd link the client library
$(BUILD)/kvtierd-bench $(BUILD)/tests/test_client: $(CLIENT_LIB)
$(BUILD)/kvtierd-bench $(BUILD)/tests/test_client: LDLIBS += $(CLIENT_LDLIBS)

$(BUILD)/kvtierd: $(DAEMON_SRC:%.c=$(BUILD)/obj/%.o) $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/%: $(BUILD)/obj/tools/%.o $(LIB)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS)

$(BUILD)/tests/%: $(BUILD)/obj/tests/%.o $(LIB)
	@mkdir -p $(dir $@)
	$(CC) $(LDFLAGS) $^ -o $@ $(LDLIBS) $(TESTLIBS)

# The CUDA backend is a plugin (build/libkvtier-cuda.so, backend/cuda/) that
# be_open("cuda") loads with dlopen, so the core never links against CUDA.
# Code for sm_80, sm_89 and sm_90 plus PTX of compute_90 for newer chips;
# the CUDA runtime is linked in statically, cuBLAS found through the rpath.
CUDA_HOME  ?= $(patsubst %/bin/nvcc,%,$(NVCC))
CUDA_SRC   := $(filter-out backend/cuda/limits.cu,$(wildcard backend/cuda/*.cu))
CUDA_OBJ   := $(CUDA_SRC:%.cu=$(BUILD)/obj/%.o)
CUDA_ARCH  ?= -gencode arch=compute_80,code=sm_80 -gencode arch=compute_89,code=sm_89 \
              -gencode arch=compute_90,code=[sm_90,compute_90]
# No --use_fast_math or -ftz: the quantized-KV codec (backend/kvq_format.h)
# must round and keep subnormals as the CPU does, byte for byte.
NVCCFLAGS  := -O2 -std=c++17 -I. -D_GNU_SOURCE -Xcompiler -fPIC,-fvisibility=hidden,-Wall,-Wextra \
              --Werror all-warnings $(CUDA_ARCH)
cuda: $(BUILD)/libkvtier-cuda.so $(BUILD)/kvtier-cuda-limits
$(BUILD)/obj/backend/cuda/%.o: backend/cuda/%.cu $(wildcard backend/cuda/*.h) backend/backend.h backend/backend_impl.h \
                               backend/arena.h backend/kvq_format.h util/q4k.h util/half.h
	@mkdir -p $(dir $@)
	$(NVCC) $(NVCCFLAGS) -c $< -o $@
$(BUILD)/libkvtier-cuda.so: $(CUDA_OBJ) $(BUILD)/obj/backend/arena.o backend/cuda/plugin.map
	$(NVCC) -shared $(CUDA_ARCH) $(filter %.o,$^) -o $@ -lcublas -lhwloc -Xlinker -rpath=$(CUDA_HOME)/lib64 \
		-Xlinker --version-script=backend/cuda/plugin.map
# the GPU's own limits for tools/gpu-check.sh's ratios
$(BUILD)/kvtier-cuda-limits: $(BUILD)/obj/backend/cuda/limits.o
	$(NVCC) $(CUDA_ARCH) $^ -o $@ -lcublas -Xlinker -rpath=$(CUDA_HOME)/lib64

# Quick tier: every test binary plus the oracle tests, each under a timeout.
test: all deps-test $(TESTS)
	@tests/run.sh $(BUILD)

# The soak test (tests/daemon_soak.py): kvtierd under mixed load, its RSS,
# fds and threads checked against the warm-up's; 15 minutes unless told.
KVTIER_SOAK_SECONDS ?= 900
soak: all
	KVTIER_BUILD=$(BUILD) KVTIER_SOAK_SECONDS=$(KVTIER_SOAK_SECONDS) /usr/bin/python3 tests/daemon_soak.py

# The figures of docs/benchmarks.md: docs/figures/*.svg from the CSVs the
# benchmark tools wrote there with --csv (the commands are in that file).
# gnuplot is a plot-time dependency only; `make test` does not run this.
.PHONY: plots
plots:
	@tools/deps.sh plot
	tools/plots.sh docs/figures

# The sanitizer run CI performs.
check-sanitize:
	$(MAKE) SANITIZE=1 test

run: all
	@tools/run.sh $(BUILD)

bench: all
	@echo "see docs/benchmarks.md for the benchmark commands"

clean:
	rm -rf build

# make install [PREFIX=/usr/local] [DESTDIR=staging]: the daemon, the CLI and
# the model tools, the built-in model (kvtierd finds it from its own path as
# ../share/kvtier/builtin), systemd units (system and user) and the sysusers
# file, man pages, and the client library (static and shared) with its
# header and kvtier.pc.  docs/operations.md.
PREFIX      ?= /usr/local
BINDIR      ?= $(PREFIX)/bin
LIBDIR      ?= $(PREFIX)/lib
INCLUDEDIR  ?= $(PREFIX)/include
DATADIR     ?= $(PREFIX)/share/kvtier
MANDIR      ?= $(PREFIX)/share/man
UNITDIR     ?= $(PREFIX)/lib/systemd/system
USERUNITDIR ?= $(PREFIX)/lib/systemd/user
SYSUSERSDIR ?= $(PREFIX)/lib/sysusers.d
INSTALL_BINS  := kvtierd kvtier kvtier-run kvtier-ppl
BUILTIN_FILES := config.json generation_config.json model.safetensors tokenizer.json tokenizer_config.json
UNITS         := kvtierd.service kvtierd.socket
# the pkg-config modules a static link of the client library needs
CLIENT_REQUIRES := libcurl jansson
SUBST = sed -e 's|@BINDIR@|$(BINDIR)|g' -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@LIBDIR@|$(LIBDIR)|g' \
	-e 's|@INCLUDEDIR@|$(INCLUDEDIR)|g' -e 's|@VERSION@|$(KVTIER_RELEASE)|g' -e 's|@CLIENT_REQUIRES@|$(CLIENT_REQUIRES)|g'

install: $(INSTALL_BINS:%=$(BUILD)/%) $(CLIENT_LIB) $(BUILD)/$(CLIENT_SONAME)
	install -d $(DESTDIR)$(BINDIR) $(DESTDIR)$(DATADIR)/builtin $(DESTDIR)$(MANDIR)/man1 $(DESTDIR)$(MANDIR)/man8 \
		$(DESTDIR)$(UNITDIR) $(DESTDIR)$(USERUNITDIR) $(DESTDIR)$(SYSUSERSDIR) \
		$(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)/kvtier
	install -m 0755 $(INSTALL_BINS:%=$(BUILD)/%) $(DESTDIR)$(BINDIR)/
	install -m 0644 $(BUILTIN_FILES:%=model/builtin/%) $(DESTDIR)$(DATADIR)/builtin/
	install -m 0644 dist/man/kvtier.1 $(DESTDIR)$(MANDIR)/man1/
	install -m 0644 dist/man/kvtierd.8 $(DESTDIR)$(MANDIR)/man8/
	for u in $(UNITS); do \
		$(SUBST) dist/systemd/system/$$u > $(DESTDIR)$(UNITDIR)/$$u && \
		$(SUBST) dist/systemd/user/$$u > $(DESTDIR)$(USERUNITDIR)/$$u || exit 1; done
	install -m 0644 dist/systemd/kvtier.sysusers $(DESTDIR)$(SYSUSERSDIR)/kvtier.conf
	install -m 0644 $(CLIENT_LIB) $(DESTDIR)$(LIBDIR)/
	install -m 0755 $(BUILD)/$(CLIENT_SONAME) $(DESTDIR)$(LIBDIR)/
	ln -sf $(CLIENT_SONAME) $(DESTDIR)$(LIBDIR)/libkvtier-client.so
	install -m 0644 client/kvtier/client.h $(DESTDIR)$(INCLUDEDIR)/kvtier/client.h
	$(SUBST) dist/kvtier.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/kvtier.pc

uninstall:
	rm -f $(INSTALL_BINS:%=$(DESTDIR)$(BINDIR)/%) $(BUILTIN_FILES:%=$(DESTDIR)$(DATADIR)/builtin/%) \
		$(DESTDIR)$(MANDIR)/man1/kvtier.1 $(DESTDIR)$(MANDIR)/man8/kvtierd.8 \
		$(UNITS:%=$(DESTDIR)$(UNITDIR)/%) $(UNITS:%=$(DESTDIR)$(USERUNITDIR)/%) $(DESTDIR)$(SYSUSERSDIR)/kvtier.conf \
		$(DESTDIR)$(LIBDIR)/libkvtier-client.a $(DESTDIR)$(LIBDIR)/libkvtier-client.so \
		$(DESTDIR)$(LIBDIR)/$(CLIENT_SONAME) \
		$(DESTDIR)$(INCLUDEDIR)/kvtier/client.h $(DESTDIR)$(LIBDIR)/pkgconfig/kvtier.pc
	rmdir $(DESTDIR)$(DATADIR)/builtin $(DESTDIR)$(DATADIR) $(DESTDIR)$(INCLUDEDIR)/kvtier 2>/dev/null || true

# make fuzz / make fuzz-ci: libFuzzer harnesses (tests/fuzz/fuzz.mk says how).
include tests/fuzz/fuzz.mk
$(FUZZ_BUILD)/obj/util/version.o: $(VERSION_STAMP)
$(FUZZ_BUILD)/obj/util/version.o: CPPFLAGS += -DKVTIER_VERSION='"$(KVTIER_VERSION)"'

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)
