// The redistribute planner's search over one-mesh-dim steps, in C++ (pybind11 module _plan_search_ext).
//
// A port of the Python search in shardwise/dtensor_ops/_redistribute_plan.py (_search_in_python,
// which stays the reference and the fallback): the same states, the same step rules
// (transition_kind), the same bytes per step (_kind_bytes over the largest local shape, the one at
// coordinate 0), the same cost tuples and the same exploration order (mesh dims in order, each
// dim's candidates in order; heap entries ordered by (cost, push counter)), so it returns the same
// steps, ties included (dtensor_ops/csrc/tests/test_plan_search_ext.py, dtensor_ops/tests/
// test_plan_search.py). Joint steps are not searched here: the Python search does them.
//
// Anything it cannot reproduce exactly (a price that is not an int, an integer that overflows 64
// bits, a state space too large to number) makes it return None, and the Python search runs.
// Prices come either from price_terms, per mesh dim and Kind code (alpha seconds, beta bytes per
// second) or None (free), computed here with the pricer's own arithmetic (round((alpha + bytes /
// beta) * 1e12) in IEEE doubles, ties to even as Python's round), or, without terms, from calling
// step_price once per distinct (kind, mesh dim, bytes, copied bytes): then it must be a pure function.
//
// Input (built by _redistribute_plan._one_dim_plan_in_cpp):
//   mesh_shape, global_shape: ints (mesh sizes >= 1, tensor sizes >= 0)
//   itemsize: int > 0
//   candidates: per mesh dim, the placements the dim may take, each (type, shard dim, reduce op id,
//     linear op): type 0 = Replicate, 1 = Shard, 2 = Partial
//   src, dst: per mesh dim, the index of its placement among that dim's candidates
//   step_price: None (rank by bytes) or callable(StepKind, (mesh_dim,), bytes, copied bytes) -> int
//   kinds: the StepKind objects, indexed by the Kind codes below
//   price_terms: None, or per mesh dim a list indexed by Kind code of (alpha_s, beta_bytes_per_s) or
//     None: the step is free, then the dim's local-copy term (StepPricer.one_dim_price_terms); given,
//     it prices every step and step_price is not called
//   (Partial reduce op id 0 is "sum": _search_in_cpp numbers it first, see kSumOp.)
// Output: None, or [(mesh_dim, index of the placement after, kind code, bytes, local copy bytes)]
// from src to dst.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <queue>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace {

constexpr int kInterfaceVersion = 3;

enum Kind : int8_t {
  kNone = -1,
  kAllGather = 0,
  kAllReduce = 1,
  kReduceScatter = 2,
  kAllToAll = 3,
  kLocalChunk = 4,
  kLocalPartial = 5,
  kShardToPartial = 6,
  kRelabel = 7,
};
constexpr int kKindCount = 8;
// Index of the local-copy term in a price_terms row, after the kinds'.
constexpr int kCopyTerm = kKindCount;
// The reduce op id of "sum".
constexpr int kSumOp = 0;

// alpha + bytes / beta of one (mesh dim, kind); absent: the step is free.
struct PriceTerm {
  double alpha_s;
  double beta_bytes_per_s;
};
using PriceRow = std::array<std::optional<PriceTerm>, kKindCount + 1>;
using PriceTerms = std::vector<PriceRow>;

inline bool is_collective(int8_t kind) { return kind >= kAllGather && kind <= kAllToAll; }

enum PlacementType : int { kReplicate = 0, kShard = 1, kPartial = 2 };

struct Candidate {
  int type;
  int dim;     // tensor dim of a Shard
  int op;      // reduce op id of a Partial (equal ids: equal op names)
  bool linear;  // a Partial whose op is sum or avg
};

// Thrown where the result could differ from the Python search's: the caller returns None.
struct Unsupported {};

inline int64_t checked_add(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_add_overflow(a, b, &out)) throw Unsupported{};
  return out;
}

inline int64_t checked_mul(int64_t a, int64_t b) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out)) throw Unsupported{};
  return out;
}

// (price or bytes, collectives or joint steps, joint steps or collectives, bytes, steps): compared
// lexicographically, as the Python search's tuples are.
using Cost = std::array<int64_t, 5>;

struct HeapEntry {
  Cost cost;
  int64_t order;
  int32_t state;
  bool operator>(const HeapEntry& other) const {
    if (cost != other.cost) return cost > other.cost;
    return order > other.order;
  }
};

struct PriceKey {
  int64_t bytes;
  int64_t copied;
  int32_t mesh_dim;
  int8_t kind;
  bool operator==(const PriceKey& other) const {
    return bytes == other.bytes && copied == other.copied && mesh_dim == other.mesh_dim && kind == other.kind;
  }
};

struct PriceKeyHash {
  size_t operator()(const PriceKey& key) const {
    uint64_t h = static_cast<uint64_t>(key.bytes) * 0x9E3779B97F4A7C15ULL ^ static_cast<uint64_t>(key.copied) * 0xC2B2AE3D27D4EB4FULL;
    h ^= (static_cast<uint64_t>(key.mesh_dim) << 8 | static_cast<uint8_t>(key.kind)) + 0x632BE59BD9B4E019ULL + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

class Search {
 public:
  Search(std::vector<int64_t> mesh_shape, std::vector<int64_t> global_shape, int64_t itemsize,
         std::vector<std::vector<Candidate>> candidates, py::object step_price, py::list kinds,
         std::optional<PriceTerms> terms)
      : mesh_(std::move(mesh_shape)),
        global_(std::move(global_shape)),
        itemsize_(itemsize),
        candidates_(std::move(candidates)),
        step_price_(std::move(step_price)),
        kinds_(std::move(kinds)),
        terms_(std::move(terms)),
        ndim_(static_cast<int>(mesh_.size())),
        tensor_ndim_(static_cast<int>(global_.size())) {
    timed_ = terms_.has_value() || !step_price_.is_none();
    // Number states in mixed radix over the per-dim candidate counts.
    uint64_t total = 1;
    strides_.resize(ndim_);
    for (int d = ndim_ - 1; d >= 0; --d) {
      uint64_t count = candidates_[d].size();
      if (count == 0 || count > 255) throw Unsupported{};
      strides_[d] = total;
      if (total > (uint64_t{1} << 40) / count) throw Unsupported{};
      total *= count;
    }
    dense_ = total <= (uint64_t{1} << 14);
    if (dense_) {
      dense_index_.assign(total, -1);
      reserve(static_cast<size_t>(total));  // every state may be numbered: no regrowth while searching
    }
  }

  py::object run(const std::vector<int>& src, const std::vector<int>& dst) {
    std::vector<uint8_t> src_state(src.begin(), src.end());
    std::vector<uint8_t> dst_state(dst.begin(), dst.end());
    const int32_t src_id = intern(src_state);
    const int32_t dst_id = intern(dst_state);

    std::priority_queue<HeapEntry, std::vector<HeapEntry>, std::greater<HeapEntry>> frontier;
    int64_t order = 0;
    const Cost zero{0, 0, 0, 0, 0};
    has_best_[src_id] = 1;
    best_[src_id] = zero;
    frontier.push(HeapEntry{zero, order++, src_id});
    bool reached = false;
    std::vector<uint8_t> next(ndim_);
    while (!frontier.empty()) {
      const HeapEntry top = frontier.top();
      frontier.pop();
      const int32_t state = top.state;
      if (done_[state]) continue;
      if (state == dst_id) {
        reached = true;
        break;
      }
      done_[state] = 1;
      const Cost cost = top.cost;
      for (int d = 0; d < ndim_; ++d) {
        const int count = static_cast<int>(candidates_[d].size());
        for (int after = 0; after < count; ++after) {
          const int8_t kind = transition_kind(state, d, after);
          if (kind == kNone) continue;
          const uint8_t* current = states_.data() + static_cast<size_t>(state) * ndim_;
          std::copy(current, current + ndim_, next.begin());
          next[d] = static_cast<uint8_t>(after);
          const int32_t new_state = intern(next);
          if (done_[new_state]) continue;
          const int64_t moved = kind_bytes(kind, state, new_state, d, after);
          // Copies are priced, not counted: the by-bytes ranking ignores them (as the Python search).
          const int64_t copied = timed_ ? copy_bytes(kind, state, new_state, d, after) : 0;
          relax(state, cost, new_state, d, after, kind, moved, copied, frontier, order);
        }
      }
    }
    if (!reached || !has_from_[dst_id]) return py::none();  // the Python search raises the error
    py::list steps;
    std::vector<int32_t> path;
    for (int32_t state = dst_id; state != src_id; state = from_[state]) path.push_back(state);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      const int32_t state = *it;
      steps.append(py::make_tuple(from_dim_[state], from_after_[state], static_cast<int>(from_kind_[state]),
                                  from_bytes_[state], from_copied_[state]));
    }
    return std::move(steps);
  }

 private:
  void reserve(size_t states) {
    states_.reserve(states * ndim_);
    done_.reserve(states);
    has_best_.reserve(states);
    best_.reserve(states);
    has_from_.reserve(states);
    from_.reserve(states);
    from_dim_.reserve(states);
    from_after_.reserve(states);
    from_kind_.reserve(states);
    from_bytes_.reserve(states);
    from_copied_.reserve(states);
    has_largest_.reserve(states);
    largest_.reserve(states * tensor_ndim_);
  }

  int32_t intern(const std::vector<uint8_t>& state) {
    uint64_t code = 0;
    for (int d = 0; d < ndim_; ++d) code += strides_[d] * state[d];
    int32_t* slot;
    if (dense_) {
      slot = &dense_index_[code];
    } else {
      auto found = sparse_index_.try_emplace(code, -1);
      slot = &found.first->second;
    }
    if (*slot >= 0) return *slot;
    const int32_t id = static_cast<int32_t>(done_.size());
    *slot = id;
    states_.insert(states_.end(), state.begin(), state.end());
    done_.push_back(0);
    has_best_.push_back(0);
    best_.push_back(Cost{});
    has_from_.push_back(0);
    from_.push_back(-1);
    from_dim_.push_back(0);
    from_after_.push_back(0);
    from_kind_.push_back(kNone);
    from_bytes_.push_back(0);
    from_copied_.push_back(0);
    has_largest_.push_back(0);
    largest_.resize(largest_.size() + tensor_ndim_);
    return id;
  }

  const Candidate& placement(int32_t state, int d) const {
    return candidates_[d][states_[static_cast<size_t>(state) * ndim_ + d]];
  }

  // Mirrors transition_kind: the kind of the step setting mesh dim d to candidate `after`, or kNone.
  int8_t transition_kind(int32_t state, int d, int after) const {
    const int before_index = states_[static_cast<size_t>(state) * ndim_ + d];
    if (before_index == after) return kNone;
    const Candidate& before = candidates_[d][before_index];
    const Candidate& next = candidates_[d][after];
    // Partials of one reduce op (a _MaskPartial and Partial("sum")) hold the same values: a relabel.
    if (before.type == kPartial && next.type == kPartial) return before.op == next.op ? kRelabel : kNone;
    if (mesh_[d] == 1) return kRelabel;
    if (before.type == kShard && sharded_after(state, d, before.dim)) return kNone;
    if (next.type == kShard && sharded_after(state, d, next.dim)) return kNone;
    if (before.type == kPartial) {
      for (int inner = d + 1; inner < ndim_; ++inner) {
        const Candidate& other = placement(state, inner);
        if (other.type == kPartial && mesh_[inner] > 1 && !(before.op == other.op || (before.linear && other.linear))) {
          return kNone;
        }
      }
    }
    if (before.type == kShard) {
      if (next.type == kReplicate) return kAllGather;
      if (next.type == kShard) return kAllToAll;
      return kShardToPartial;
    }
    if (before.type == kReplicate) return next.type == kShard ? kLocalChunk : kLocalPartial;
    return next.type == kReplicate ? kAllReduce : kReduceScatter;
  }

  // Whether a mesh dim after d (of size > 1) shards tensor dim `tensor_dim` in `state`.
  bool sharded_after(int32_t state, int d, int tensor_dim) const {
    for (int inner = d + 1; inner < ndim_; ++inner) {
      const Candidate& other = placement(state, inner);
      if (other.type == kShard && other.dim == tensor_dim && mesh_[inner] > 1) return true;
    }
    return false;
  }

  // The local shape at coordinate 0 (the largest piece: torch.chunk puts it first at every level).
  const int64_t* largest(int32_t state) {
    int64_t* shape = largest_.data() + static_cast<size_t>(state) * tensor_ndim_;
    if (!has_largest_[state]) {
      std::copy(global_.begin(), global_.end(), shape);
      for (int d = 0; d < ndim_; ++d) {
        const Candidate& p = placement(state, d);
        if (p.type == kShard) shape[p.dim] = (shape[p.dim] + mesh_[d] - 1) / mesh_[d];
      }
      has_largest_[state] = 1;
    }
    return shape;
  }

  int64_t elements(const int64_t* shape) const {
    int64_t count = 1;
    for (int i = 0; i < tensor_ndim_; ++i) count = checked_mul(count, shape[i]);
    return count;
  }

  // Mirrors _kind_bytes.
  int64_t kind_bytes(int8_t kind, int32_t state, int32_t new_state, int d, int after) {
    if (!is_collective(kind)) return 0;
    const int64_t* before = largest(state);
    const int64_t* next = largest(new_state);
    const int64_t group = mesh_[d];
    const int64_t peers = group - 1;
    int64_t count;
    if (kind == kAllGather) {
      count = checked_mul(peers, elements(before));
    } else if (kind == kReduceScatter) {
      count = checked_mul(peers, elements(next));
    } else if (kind == kAllReduce) {
      const int64_t local = elements(before);
      count = checked_mul(checked_mul(2, peers), local / group + (local % group != 0));
    } else {
      const int j = candidates_[d][after].dim;
      int64_t block = 1;
      for (int i = 0; i < tensor_ndim_; ++i) block = checked_mul(block, i == j ? next[i] : before[i]);
      count = checked_mul(peers, block);
    }
    return checked_mul(count, itemsize_);
  }

  // Mirrors local_copy_bytes.
  int64_t copy_bytes(int8_t kind, int32_t state, int32_t new_state, int d, int after) {
    const Candidate& was = placement(state, d);
    const Candidate& now = candidates_[d][after];
    const int64_t* before = largest(state);
    const int64_t* next = largest(new_state);
    const int64_t n = mesh_[d];
    const int64_t before_elements = elements(before);
    const int64_t after_elements = elements(next);
    int64_t count = 0;
    if (kind == kAllGather) {
      const int i = was.dim;
      const bool uneven = checked_mul(before[i], n) != next[i];
      if (uneven) count = before_elements;
      bool leading_ones = true;  // only dims of size 1 before i: the received blocks are a view
      for (int k = 0; k < i; ++k) leading_ones = leading_ones && before[k] == 1;
      if (!leading_ones) {
        count = checked_add(count, checked_add(checked_mul(n, before_elements), uneven ? after_elements : 0));
      }
    } else if (kind == kReduceScatter) {
      const int j = now.dim;
      const bool uneven = checked_mul(next[j], n) != before[j];
      const int64_t sent = checked_mul(n, after_elements);
      if (uneven) count = sent;
      if (j != 0) count = checked_add(count, checked_add(sent, uneven ? after_elements : 0));
    } else if (kind == kAllToAll) {
      const int i = was.dim;
      const int j = now.dim;
      int64_t block = 1;
      for (int k = 0; k < tensor_ndim_; ++k) block = checked_mul(block, k == j ? next[k] : before[k]);
      const int64_t sent = checked_mul(n, block);
      const bool uneven = checked_mul(before[i], n) != next[i] || checked_mul(next[j], n) != before[j];
      const int64_t regroupings = (uneven ? 1 : 0) + (i != 0 ? 1 : 0) + (j != 0 ? 1 : 0);
      count = checked_add(checked_mul(sent, regroupings), uneven ? after_elements : 0);
    } else if (kind == kLocalChunk) {
      count = now.dim != 0 ? after_elements : 0;
    } else if (kind == kLocalPartial) {
      count = now.op == kSumOp ? before_elements : 0;
    } else if (kind == kShardToPartial) {
      count = checked_add(after_elements, before_elements);
    }
    return checked_mul(count, itemsize_);
  }

  int64_t price(int8_t kind, int d, int64_t moved, int64_t copied) {
    if (terms_) return priced_by_terms(kind, (*terms_)[d], moved, copied);
    const PriceKey key{moved, copied, d, kind};
    auto found = prices_.find(key);
    if (found != prices_.end()) return found->second;
    py::object result = step_price_(kinds_[kind], py::make_tuple(d), moved, copied);
    if (!PyLong_Check(result.ptr())) throw Unsupported{};
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(result.ptr(), &overflow);
    if (overflow != 0) throw Unsupported{};
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    prices_.emplace(key, value);
    return value;
  }

  // Mirrors StepPricer.step_picoseconds (step_time): the same double operations in the same order
  // (built with -ffp-contract=off), rounded to whole picoseconds, ties to even. A collective: its
  // alpha + bytes / beta, plus the copy term's alpha + copied / beta where it copies; a local step
  // (priced as a local copy): alpha + (bytes + copied) / beta.
  static int64_t priced_by_terms(int8_t kind, const PriceRow& row, int64_t moved, int64_t copied) {
    const std::optional<PriceTerm>& term = row[kind];
    double seconds;
    if (is_collective(kind)) {
      // No term: a group of one rank, which moves nothing (its copies still cost).
      seconds = term ? term->alpha_s + static_cast<double>(moved) / term->beta_bytes_per_s : 0.0;
      const std::optional<PriceTerm>& copy = row[kCopyTerm];
      if (copied != 0 && copy) seconds += copy->alpha_s + static_cast<double>(copied) / copy->beta_bytes_per_s;
    } else {
      if (!term) return 0;  // a relabel
      seconds = term->alpha_s + static_cast<double>(checked_add(moved, copied)) / term->beta_bytes_per_s;
    }
    const double picoseconds = seconds * 1e12;
    if (!(picoseconds >= 0.0 && picoseconds < 9.2e18)) throw Unsupported{};
    return static_cast<int64_t>(std::nearbyint(picoseconds));
  }

  void relax(int32_t state, const Cost& cost, int32_t new_state, int d, int after, int8_t kind, int64_t moved,
             int64_t copied,
             std::priority_queue<HeapEntry, std::vector<HeapEntry>, std::greater<HeapEntry>>& frontier,
             int64_t& order) {
    const int64_t collective = is_collective(kind) ? 1 : 0;
    Cost added;
    if (timed_) {
      added = {price(kind, d, moved, copied), collective, 0, moved, 1};
    } else {
      added = {moved, 0, collective, moved, 1};
    }
    Cost new_cost;
    for (int i = 0; i < 5; ++i) new_cost[i] = checked_add(cost[i], added[i]);
    if (!has_best_[new_state] || new_cost < best_[new_state]) {
      has_best_[new_state] = 1;
      best_[new_state] = new_cost;
      has_from_[new_state] = 1;
      from_[new_state] = state;
      from_dim_[new_state] = d;
      from_after_[new_state] = after;
      from_kind_[new_state] = kind;
      from_bytes_[new_state] = moved;
      from_copied_[new_state] = copied;
      frontier.push(HeapEntry{new_cost, order++, new_state});
    }
  }

  std::vector<int64_t> mesh_;
  std::vector<int64_t> global_;
  int64_t itemsize_;
  std::vector<std::vector<Candidate>> candidates_;
  py::object step_price_;
  py::list kinds_;
  std::optional<PriceTerms> terms_;
  int ndim_;
  int tensor_ndim_;
  bool timed_ = false;

  std::vector<uint64_t> strides_;
  bool dense_ = true;
  std::vector<int32_t> dense_index_;
  std::unordered_map<uint64_t, int32_t> sparse_index_;

  // Per numbered state.
  std::vector<uint8_t> states_;  // ndim_ candidate indices each
  std::vector<uint8_t> done_;
  std::vector<uint8_t> has_best_;
  std::vector<Cost> best_;
  std::vector<uint8_t> has_from_;
  std::vector<int32_t> from_;
  std::vector<int> from_dim_;
  std::vector<int> from_after_;
  std::vector<int8_t> from_kind_;
  std::vector<int64_t> from_bytes_;
  std::vector<int64_t> from_copied_;
  std::vector<uint8_t> has_largest_;
  std::vector<int64_t> largest_;

  std::unordered_map<PriceKey, int64_t, PriceKeyHash> prices_;
};

py::object search(std::vector<int64_t> mesh_shape, std::vector<int64_t> global_shape, int64_t itemsize,
                  std::vector<std::vector<std::tuple<int, int, int, bool>>> candidates, std::vector<int> src,
                  std::vector<int> dst, py::object step_price, py::list kinds, py::object price_terms) {
  const size_t ndim = mesh_shape.size();
  if (candidates.size() != ndim || src.size() != ndim || dst.size() != ndim || itemsize <= 0) {
    throw py::value_error("plan_search.search: inconsistent arguments");
  }
  for (int64_t size : mesh_shape) {
    if (size < 1) return py::none();
  }
  for (int64_t size : global_shape) {
    if (size < 0) return py::none();
  }
  std::vector<std::vector<Candidate>> placements(ndim);
  for (size_t d = 0; d < ndim; ++d) {
    for (const auto& [type, dim, op, linear] : candidates[d]) {
      if (type < kReplicate || type > kPartial || (type == kShard && (dim < 0 || static_cast<size_t>(dim) >= global_shape.size()))) {
        throw py::value_error("plan_search.search: bad candidate placement");
      }
      placements[d].push_back(Candidate{type, dim, op, linear});
    }
    if (src[d] < 0 || dst[d] < 0 || static_cast<size_t>(src[d]) >= placements[d].size() ||
        static_cast<size_t>(dst[d]) >= placements[d].size()) {
      throw py::value_error("plan_search.search: src/dst index out of range");
    }
  }
  std::optional<PriceTerms> terms;
  if (!price_terms.is_none()) {
    const auto rows = price_terms.cast<std::vector<py::sequence>>();
    if (rows.size() != ndim) throw py::value_error("plan_search.search: price_terms needs one row per mesh dim");
    terms.emplace(ndim);
    for (size_t d = 0; d < ndim; ++d) {
      if (rows[d].size() != kKindCount + 1) {
        throw py::value_error("plan_search.search: a price_terms row needs one entry per kind and the copy term");
      }
      for (int kind = 0; kind <= kKindCount; ++kind) {
        const py::object entry = rows[d][kind];
        if (entry.is_none()) continue;
        const auto [alpha, beta] = entry.cast<std::pair<double, double>>();
        if (!(alpha >= 0.0 && beta > 0.0)) throw py::value_error("plan_search.search: price terms need alpha >= 0 and beta > 0");
        (*terms)[d][kind] = PriceTerm{alpha, beta};
      }
    }
  }
  try {
    Search run(std::move(mesh_shape), std::move(global_shape), itemsize, std::move(placements), std::move(step_price),
               std::move(kinds), std::move(terms));
    return run.run(src, dst);
  } catch (const Unsupported&) {
    return py::none();
  }
}

}  // namespace

PYBIND11_MODULE(_plan_search_ext, module) {
  module.doc() = "The redistribute planner's one-mesh-dim search (see dtensor_ops/csrc/plan_search.cpp)";
  module.attr("INTERFACE_VERSION") = kInterfaceVersion;
  module.def("search", &search, py::arg("mesh_shape"), py::arg("global_shape"), py::arg("itemsize"),
             py::arg("candidates"), py::arg("src"), py::arg("dst"), py::arg("step_price"), py::arg("kinds"),
             py::arg("price_terms") = py::none());
}
