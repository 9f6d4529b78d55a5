// run_events.cpp: building and checking the events of events.jsonl (see run_events.h).
#include "run_events.h"

#include <cmath>
#include <initializer_list>

namespace moe {

using nlohmann::json;

// ---- building events ----

namespace {

// JSON has no NaN or infinity; null says "no value" honestly instead of a made-up number.
json number_or_null(double value) { return std::isfinite(value) ? json(value) : json(nullptr); }

}  // namespace

json step_event(int64_t step, const std::vector<std::pair<std::string, double>>& metrics) {
  json event = {{"type", event_type::step}, {"step", step}};
  for (const auto& [name, value] : metrics) event[name] = number_or_null(value);
  return event;
}

json to_event(const RoutingEvent& e) {
  json event = {{"type", event_type::routing},
                {"step", e.step},
                {"layer", e.layer},
                {"tokens_per_expert", e.tokens_per_expert},
                {"dropped_per_expert", e.dropped_per_expert}};
  if (e.capacity) event["capacity"] = *e.capacity;
  if (!e.tokens_per_expert_by_genre.empty()) {
    event["tokens_per_expert_by_genre"] = e.tokens_per_expert_by_genre;
  }
  return event;
}

json to_event(const TopologyEvent& e) {
  return {{"type", event_type::topology}, {"step", e.step},
          {"layer", e.layer},             {"block_size", e.block_size},
          {"block_rows", e.block_rows},   {"block_cols", e.block_cols},
          {"nnz", e.nnz},                 {"padding_rows", e.padding_rows},
          {"rows_per_expert", e.rows_per_expert}};
}

json to_event(const ExpertLoadEvent& e) {
  return {{"type", event_type::expert_load}, {"step", e.step}, {"layer", e.layer}, {"tokens", e.tokens}};
}

json to_event(const SpanEvent& e) {
  json event = {{"type", event_type::span}, {"step", e.step},          {"rank", e.rank},
                {"stream", e.stream},       {"name", e.name},          {"start_us", e.start_us},
                {"duration_us", e.duration_us}};
  if (!e.stream_name.empty()) event["stream_name"] = e.stream_name;
  return event;
}

json to_event(const AllToAllEvent& e) {
  json event = {{"type", event_type::alltoall}, {"step", e.step},
                {"name", e.name},               {"bytes", e.bytes},
                {"duration_us", e.duration_us}, {"rank", e.rank}};
  if (e.layer) event["layer"] = *e.layer;
  if (e.start_us) event["start_us"] = *e.start_us;
  return event;
}

json to_event(const OffloadEvent& e) {
  return {{"type", event_type::offload}, {"step", e.step},         {"layer", e.layer},
          {"hits", e.hits},              {"misses", e.misses},     {"stall_us", e.stall_us},
          {"prefetched", e.prefetched}};
}

json to_event(const TokensEvent& e) {
  return {{"type", event_type::tokens},
          {"step", e.step},
          {"layer", e.layer},
          {"text", e.text},
          {"experts", e.experts}};
}

json to_event(const TableEvent& e) {
  return {{"type", event_type::table}, {"name", e.name}, {"columns", e.columns}, {"rows", e.rows}};
}

json to_event(const VerdictEvent& e) {
  json event = {{"type", event_type::verdict}, {"pass", e.pass}, {"message", e.message}};
  if (e.step) event["step"] = *e.step;
  return event;
}

// ---- checking events ----

namespace {

enum class Kind { integer, number, string, boolean, array, integer_array, integer_matrix };

const char* describe(Kind kind) {
  switch (kind) {
    case Kind::integer: return "an integer";
    case Kind::number: return "a number";
    case Kind::string: return "a string";
    case Kind::boolean: return "true or false";
    case Kind::array: return "an array";
    case Kind::integer_array: return "an array of integers";
    case Kind::integer_matrix: return "an array of arrays of integers";
  }
  return "?";
}

bool is_integer_array(const json& value) {
  if (!value.is_array()) return false;
  for (const json& item : value) {
    if (!item.is_number_integer()) return false;
  }
  return true;
}

bool has_kind(const json& value, Kind kind) {
  switch (kind) {
    case Kind::integer: return value.is_number_integer();
    case Kind::number: return value.is_number();
    case Kind::string: return value.is_string();
    case Kind::boolean: return value.is_boolean();
    case Kind::array: return value.is_array();
    case Kind::integer_array: return is_integer_array(value);
    case Kind::integer_matrix:
      if (!value.is_array()) return false;
      for (const json& row : value) {
        if (!is_integer_array(row)) return false;
      }
      return true;
  }
  return false;
}

struct Field {
  const char* name;
  Kind kind;
  bool required;
};

// The fields the viewer relies on, per known type. Anything else in an event is free-form.
struct TypeRule {
  std::string_view type;
  std::initializer_list<Field> fields;
};

const TypeRule kRules[] = {
    {event_type::step, {{"step", Kind::integer, true}}},
    {event_type::routing,
     {{"layer", Kind::integer, true},
      {"tokens_per_expert", Kind::integer_array, true},
      {"dropped_per_expert", Kind::integer_array, false},
      {"capacity", Kind::integer, false}}},
    {event_type::expert_load, {{"layer", Kind::integer, true}, {"tokens", Kind::integer_matrix, true}}},
    {event_type::topology,
     {{"layer", Kind::integer, true},
      {"block_size", Kind::integer, true},
      {"block_rows", Kind::integer, true},
      {"block_cols", Kind::integer, true},
      {"nnz", Kind::integer, true},
      {"padding_rows", Kind::integer, false},
      {"rows_per_expert", Kind::integer_array, false}}},
    {event_type::span,
     {{"rank", Kind::integer, true},
      {"stream", Kind::integer, true},
      {"name", Kind::string, true},
      {"start_us", Kind::number, true},
      {"duration_us", Kind::number, true},
      {"stream_name", Kind::string, false}}},
    {event_type::alltoall,
     {{"bytes", Kind::integer_matrix, true},
      {"duration_us", Kind::number, true},
      {"start_us", Kind::number, false},
      {"rank", Kind::integer, false},
      {"layer", Kind::integer, false},
      {"name", Kind::string, false}}},
    {event_type::offload,
     {{"layer", Kind::integer, true},
      {"hits", Kind::integer, true},
      {"misses", Kind::integer, true},
      {"stall_us", Kind::number, false},
      {"prefetched", Kind::integer_array, false}}},
    {event_type::tokens,
     {{"layer", Kind::integer, true},
      {"text", Kind::string, true},
      {"experts", Kind::integer_matrix, true}}},
    {event_type::table,
     {{"name", Kind::string, true}, {"columns", Kind::array, true}, {"rows", Kind::array, true}}},
    {event_type::verdict, {{"pass", Kind::boolean, true}, {"message", Kind::string, true}}},
};

}  // namespace

std::string validate_event(const json& event) {
  if (!event.is_object()) return std::string("an event must be a JSON object, found ") + event.type_name();
  auto type = event.find("type");
  if (type == event.end()) return "the event has no \"type\"";
  if (!type->is_string()) return "\"type\" must be a string";
  auto step = event.find("step");
  if (step != event.end() && !step->is_number_integer()) {
    return "\"step\" must be an integer, found " + std::string(step->type_name());
  }
  const std::string& name = type->get_ref<const std::string&>();
  for (const TypeRule& rule : kRules) {
    if (rule.type != name) continue;
    for (const Field& field : rule.fields) {
      auto it = event.find(field.name);
      if (it == event.end()) {
        if (field.required) return "\"" + name + "\" event: required field \"" + field.name + "\" is missing";
        continue;
      }
      // A NaN metric written as null is allowed in optional number fields.
      if (!field.required && field.kind == Kind::number && it->is_null()) continue;
      if (!has_kind(*it, field.kind)) {
        return "\"" + name + "\" event: field \"" + field.name + "\" must be " + describe(field.kind) +
               ", found " + it->type_name();
      }
    }
  }
  return "";
}

bool is_exposed_communication(std::string_view span_name) {
  return span_name == "ep_count_exchange" || span_name == "ep_wait_dispatch" || span_name == "ep_wait_combine" ||
         span_name == "ep_router_all_reduce" || span_name == "gradient_all_reduce";
}

}  // namespace moe
