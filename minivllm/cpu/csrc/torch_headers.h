// The torch headers the library's sources include, parsed once per build instead of once per
// source: minivllm/cpu/precompiled_header.py compiles this file into a GCC precompiled header
// (torch_headers.h.gch) in the build folder, and every source is compiled with
// `-include torch_headers.h`. Each source still includes what it uses itself; those includes then
// cost nothing. Only headers some source includes belong here, never <ATen/ATen.h> (every op of
// ATen: most of a compile's time, for the handful of ops the kernels call).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/mm.h>
#include <c10/util/Half.h>
#include <torch/library.h>
