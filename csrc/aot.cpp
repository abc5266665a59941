// ragged._C: the ahead-of-time build of csrc/ (built with RAGGED_BUILD_CUDA=1; see setup.py).
//
// The kernels are compiled by nvcc from the same .cu files the NVRTC path compiles; setup.py
// generates, per source, a translation unit that includes it and lists its extern "C" kernels
// (read by ragged/kernels/cuda/instances.py, the NVRTC path's parser) with the address of each
// host stub. This module only hands Python a kernel's CUfunction for the current device
// (cudaGetFuncBySymbol); Python launches it through the driver exactly as it launches an NVRTC
// kernel. Plain integers cross the boundary: no torch headers, so one binary serves every torch.

#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

struct RaggedAotEntry {
    const char* name;
    const void* stub;
};

// Defined by setup.py's generated registry: every kernel of every source.
extern "C" const RaggedAotEntry* ragged_aot_kernels(int* count);

#ifndef RAGGED_AOT_ARCHS
#define RAGGED_AOT_ARCHS ""
#endif
#ifndef RAGGED_AOT_PTX
#define RAGGED_AOT_PTX 0
#endif
#ifndef RAGGED_AOT_NVCC
#define RAGGED_AOT_NVCC ""
#endif

namespace {

const std::unordered_map<std::string, const void*>& table() {
    static const std::unordered_map<std::string, const void*> map = [] {
        std::unordered_map<std::string, const void*> m;
        int n = 0;
        const RaggedAotEntry* entries = ragged_aot_kernels(&n);
        for (int i = 0; i < n; ++i) m.emplace(entries[i].name, entries[i].stub);
        return m;
    }();
    return map;
}

void check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
        throw std::runtime_error(std::string("ragged._C: ") + what + ": " + cudaGetErrorString(err));
    }
}

// The CUfunction of `name` in the primary context of `device` (an int: cudaFunction_t is a CUfunction).
std::uintptr_t function(const std::string& name, int device) {
    const auto& m = table();
    auto it = m.find(name);
    if (it == m.end()) throw py::key_error("ragged._C.function(): no kernel named " + name);
    int current = -1;
    check(cudaGetDevice(&current), "cudaGetDevice");
    if (current != device) check(cudaSetDevice(device), "cudaSetDevice");
    cudaFunction_t fn = nullptr;
    cudaError_t err = cudaGetFuncBySymbol(&fn, it->second);
    if (current != device) cudaSetDevice(current);
    check(err, ("cudaGetFuncBySymbol(" + name + ")").c_str());
    return reinterpret_cast<std::uintptr_t>(fn);
}

std::vector<std::string> kernels() {
    std::vector<std::string> names;
    for (const auto& kv : table()) names.push_back(kv.first);
    return names;
}

std::vector<int> archs() {
    std::vector<int> out;
    std::string s = RAGGED_AOT_ARCHS;
    size_t start = 0;
    while (start < s.size()) {
        size_t end = s.find(',', start);
        if (end == std::string::npos) end = s.size();
        if (end > start) out.push_back(std::stoi(s.substr(start, end - start)));
        start = end + 1;
    }
    return out;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
    m.doc() = "ragged's CUDA kernels compiled ahead of time (see ragged/kernels/cuda/launch.py)";
    m.def("function", &function, py::arg("name"), py::arg("device"),
          "CUfunction (an int) of kernel `name` in the primary context of `device`");
    m.def("kernels", &kernels, "names of every kernel in this build");
    m.def("archs", &archs, "the SM architectures (e.g. 80, 90) this build holds machine code for");
    m.attr("ptx_arch") = RAGGED_AOT_PTX;  // PTX of this compute capability is embedded too (0: none)
    m.attr("nvcc_version") = RAGGED_AOT_NVCC;
    m.attr("cuda_runtime_version") = CUDART_VERSION;
}
