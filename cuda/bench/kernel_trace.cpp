// kernel_trace.cpp: see kernel_trace.h. CUPTI's activity API: CUPTI asks for buffers
// (buffer_requested), fills them with records as kernels complete, and hands each full buffer back
// (buffer_completed), from its own thread; cuptiActivityFlushAll hands back the partly filled ones.
#include "bench/kernel_trace.h"

#include <cupti.h>
#include <cxxabi.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <stdexcept>

namespace moe::bench {
namespace {

std::mutex g_mutex;
std::vector<KernelRecord> g_records;  // completed kernels not yet taken
bool g_active = false;

void check(CUptiResult result, const char* what) {
  if (result == CUPTI_SUCCESS) return;
  const char* message = nullptr;
  cuptiGetResultString(result, &message);
  throw std::runtime_error(std::string("kernel trace: ") + what + ": " + (message ? message : "unknown CUPTI error"));
}

std::string demangle(const char* name) {
  if (name == nullptr) return "?";
  int status = 0;
  std::unique_ptr<char, decltype(&std::free)> text(abi::__cxa_demangle(name, nullptr, nullptr, &status), &std::free);
  return status == 0 && text ? std::string(text.get()) : std::string(name);
}

constexpr size_t kBufferBytes = size_t{4} << 20;  // about 20000 kernel records
constexpr size_t kAlignment = 8;                  // CUPTI's requirement for activity buffers

void CUPTIAPI buffer_requested(uint8_t** buffer, size_t* size, size_t* max_records) {
  *buffer = static_cast<uint8_t*>(std::aligned_alloc(kAlignment, kBufferBytes));
  *size = *buffer ? kBufferBytes : 0;
  *max_records = 0;  // as many as fit
}

void CUPTIAPI buffer_completed(CUcontext, uint32_t, uint8_t* buffer, size_t, size_t valid_bytes) {
  std::vector<KernelRecord> records;
  CUpti_Activity* record = nullptr;
  while (cuptiActivityGetNextRecord(buffer, valid_bytes, &record) == CUPTI_SUCCESS) {
    if (record->kind == CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) {
      const auto* kernel = reinterpret_cast<const CUpti_ActivityKernel10*>(record);
      records.push_back({demangle(kernel->name), kernel->start, kernel->end});
    } else if (record->kind == CUPTI_ACTIVITY_KIND_MEMSET) {
      const auto* memset = reinterpret_cast<const CUpti_ActivityMemset4*>(record);
      records.push_back({"memset", memset->start, memset->end});
    }
  }
  std::free(buffer);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.insert(g_records.end(), records.begin(), records.end());
}

}  // namespace

KernelTrace::KernelTrace() {
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (g_active) throw std::logic_error("kernel trace: one KernelTrace at a time");
    g_active = true;
    g_records.clear();
  }
  try {
    check(cuptiActivityRegisterCallbacks(buffer_requested, buffer_completed), "cuptiActivityRegisterCallbacks");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "cuptiActivityEnable(CONCURRENT_KERNEL)");
    check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "cuptiActivityEnable(MEMSET)");
  } catch (...) {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_active = false;
    throw;
  }
}

KernelTrace::~KernelTrace() {
  cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL);
  cuptiActivityDisable(CUPTI_ACTIVITY_KIND_MEMSET);
  std::lock_guard<std::mutex> lock(g_mutex);
  g_records.clear();
  g_active = false;
}

std::vector<KernelRecord> KernelTrace::take() {
  check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
  std::vector<KernelRecord> records;
  {
    std::lock_guard<std::mutex> lock(g_mutex);
    records.swap(g_records);
  }
  std::sort(records.begin(), records.end(),
            [](const KernelRecord& a, const KernelRecord& b) { return a.start_ns < b.start_ns; });
  return records;
}

std::string short_kernel_name(const std::string& name, size_t width) {
  static const std::regex qualifier("([A-Za-z_][A-Za-z0-9_]*|\\(anonymous namespace\\))::");
  std::string text = std::regex_replace(name, qualifier, "");
  if (text.rfind("void ", 0) == 0) text.erase(0, 5);
  const size_t open = text.find_first_of("<(");
  const std::string base = text.substr(0, open);
  if (open != std::string::npos && text[open] == '<') {
    // The first template argument whose type name ends in "Problem", with its own arguments.
    static const std::regex problem("[A-Za-z_][A-Za-z0-9_]*Problem\\b");
    std::smatch match;
    if (std::regex_search(text, match, problem)) {
      size_t end = match.position(0) + match.length(0);
      if (end < text.size() && text[end] == '<') {
        for (int depth = 0; end < text.size(); ++end) {
          depth += text[end] == '<' ? 1 : text[end] == '>' ? -1 : 0;
          if (depth == 0) break;
        }
        ++end;
      }
      return base + "<" + text.substr(match.position(0), end - match.position(0)) + ">";
    }
  }
  return text.substr(0, std::min(width, text.find('(')));  // npos when there is no argument list
}

std::vector<KernelShare> kernel_shares(const std::vector<KernelRecord>& records, int64_t steps, size_t width) {
  if (steps < 1) throw std::invalid_argument("kernel trace: steps must be >= 1, got " + std::to_string(steps));
  std::map<std::string, KernelShare> by_name;
  for (const KernelRecord& k : records) {
    KernelShare& share = by_name[short_kernel_name(k.name, width)];
    share.ms_per_step += double(k.end_ns - k.start_ns) * 1e-6 / double(steps);
    share.launches_per_step += 1.0 / double(steps);
  }
  std::vector<KernelShare> shares;
  for (auto& [name, share] : by_name) {
    share.name = name;
    shares.push_back(share);
  }
  std::stable_sort(shares.begin(), shares.end(),
                   [](const KernelShare& a, const KernelShare& b) { return a.ms_per_step > b.ms_per_step; });
  return shares;
}

KernelTraceSummary summarize_runs(const std::vector<KernelRecord>& records, int runs) {
  if (runs < 1 || records.empty() || records.size() % size_t(runs) != 0) {
    throw std::invalid_argument("kernel trace: " + std::to_string(records.size()) + " kernels do not cut into " +
                                std::to_string(runs) + " equal runs");
  }
  const size_t per_run = records.size() / size_t(runs);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const size_t n = v.size();
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  };
  KernelTraceSummary summary;
  summary.runs = runs;
  for (size_t i = 0; i < per_run; ++i) {
    std::vector<double> duration, gap;
    for (int r = 0; r < runs; ++r) {
      const size_t at = size_t(r) * per_run + i;
      const KernelRecord& k = records[at];
      if (k.name != records[i].name) {
        throw std::invalid_argument("kernel trace: run " + std::to_string(r) + " kernel " + std::to_string(i) + " is " +
                                    short_kernel_name(k.name) + ", run 0's is " + short_kernel_name(records[i].name));
      }
      duration.push_back(double(k.end_ns - k.start_ns) * 1e-6);
      if (at > 0) gap.push_back(std::max(0.0, double(int64_t(k.start_ns) - int64_t(records[at - 1].end_ns)) * 1e-6));
    }
    KernelTraceSummary::Kernel kernel{short_kernel_name(records[i].name), median(duration), gap.empty() ? 0.0 : median(gap)};
    summary.sum_kernels_ms += kernel.median_ms;
    summary.sum_gaps_ms += kernel.median_gap_before_ms;
    summary.kernels.push_back(kernel);
  }
  std::vector<double> spans;
  for (int r = 0; r < runs; ++r) {
    const uint64_t first = records[size_t(r) * per_run].start_ns;
    const uint64_t next = r + 1 < runs ? records[size_t(r + 1) * per_run].start_ns : records[size_t(r + 1) * per_run - 1].end_ns;
    if (r + 1 < runs || runs == 1) spans.push_back(double(next - first) * 1e-6);
  }
  summary.median_span_ms = median(spans);
  return summary;
}

}  // namespace moe::bench
