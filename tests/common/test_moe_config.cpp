// test_moe_config.cpp: MoeConfig validation, capacity rounding, name parsing and the JSON form.
//   ctest --test-dir build -R MoeConfig
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>

#include "moe_config.h"
#include "config_json.h"

namespace moe {
namespace {

MoeConfig valid_config(Formulation formulation = Formulation::dropless) {
  MoeConfig c;
  c.tokens = 64;
  c.model_dim = 32;
  c.hidden_dim = 256;
  c.num_experts = 8;
  c.top_k = 2;
  c.formulation = formulation;
  c.block_size = 128;
  return c;
}

// validate() must throw std::invalid_argument whose message names the field and the value.
void expect_rejected(const MoeConfig& c, const std::string& field, const std::string& value) {
  try {
    validate(c);
    FAIL() << "validate accepted a config with bad " << field << " = " << value;
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find(field), std::string::npos) << message;
    EXPECT_NE(message.find("= " + value), std::string::npos) << message;
  }
}

TEST(MoeConfigValidate, AcceptsAValidConfigInEveryFormulation) {
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    EXPECT_NO_THROW(validate(valid_config(f))) << to_string(f);
  }
}

TEST(MoeConfigValidate, RejectsTopKLargerThanExperts) {
  MoeConfig c = valid_config();
  c.top_k = 9;
  expect_rejected(c, "top_k", "9");
}

TEST(MoeConfigValidate, RejectsTopKZero) {
  MoeConfig c = valid_config();
  c.top_k = 0;
  expect_rejected(c, "top_k", "0");
}

TEST(MoeConfigValidate, RejectsBadCapacityFactorForDroppingAndPadded) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (Formulation f : {Formulation::dropping, Formulation::padded}) {
    for (auto [factor, text] : {std::pair{0.0, "0"}, std::pair{-1.5, "-1.5"}, std::pair{nan, "nan"}}) {
      MoeConfig c = valid_config(f);
      c.capacity_factor = factor;
      SCOPED_TRACE(std::string(to_string(f)) + " capacity_factor " + text);
      expect_rejected(c, "capacity_factor", text);
    }
  }
}

TEST(MoeConfigValidate, DroplessIgnoresCapacityFactor) {
  for (double factor : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), 1e9}) {
    MoeConfig c = valid_config(Formulation::dropless);
    c.capacity_factor = factor;
    EXPECT_NO_THROW(validate(c)) << factor;
  }
}

TEST(MoeConfigValidate, RejectsHiddenNotAMultipleOfBlockForDropless) {
  MoeConfig c = valid_config(Formulation::dropless);
  c.hidden_dim = 200;
  expect_rejected(c, "hidden_dim", "200");
  c.formulation = Formulation::dropping;  // only dropless tiles H by B
  EXPECT_NO_THROW(validate(c));
}

TEST(MoeConfigValidate, RejectsDimensionsBelowOne) {
  {
    MoeConfig c = valid_config();
    c.tokens = 0;
    expect_rejected(c, "tokens", "0");
  }
  {
    MoeConfig c = valid_config();
    c.model_dim = -3;
    expect_rejected(c, "model_dim", "-3");
  }
  {
    MoeConfig c = valid_config();
    c.hidden_dim = 0;
    expect_rejected(c, "hidden_dim", "0");
  }
  {
    MoeConfig c = valid_config();
    c.num_experts = 0;
    expect_rejected(c, "num_experts", "0");
  }
}

TEST(MoeConfigValidate, RejectsJitterOutsideZeroToOne) {
  for (auto [eps, text] : {std::pair{-0.1, "-0.1"}, std::pair{1.0, "1"}, std::pair{2.5, "2.5"},
                           std::pair{std::numeric_limits<double>::quiet_NaN(), "nan"}}) {
    MoeConfig c = valid_config();
    c.jitter_eps = eps;
    SCOPED_TRACE(text);
    expect_rejected(c, "jitter_eps", text);
  }
  MoeConfig c = valid_config();
  c.jitter_eps = 0.0;
  EXPECT_NO_THROW(validate(c));
  c.jitter_eps = 0.99;
  EXPECT_NO_THROW(validate(c));
}

TEST(MoeConfigCapacity, RoundsUp) {
  MoeConfig c = valid_config(Formulation::dropping);
  c.tokens = 10, c.top_k = 1, c.num_experts = 3, c.capacity_factor = 1.0;
  EXPECT_EQ(capacity(c), 4);  // 10/3 = 3.33 -> 4
  c.tokens = 12;
  EXPECT_EQ(capacity(c), 4);  // exact: no rounding up
  c.tokens = 8, c.top_k = 2, c.num_experts = 4, c.capacity_factor = 1.25;
  EXPECT_EQ(capacity(c), 5);  // 1.25 * 16 / 4 = 5
  c.capacity_factor = 1.3;
  EXPECT_EQ(capacity(c), 6);  // 5.2 -> 6
}

TEST(MoeConfigNames, ParseAcceptsNamesAndRejectsOthersListingAllowed) {
  EXPECT_EQ(parse_formulation("dropping"), Formulation::dropping);
  EXPECT_EQ(parse_formulation("padded"), Formulation::padded);
  EXPECT_EQ(parse_formulation("dropless"), Formulation::dropless);
  EXPECT_EQ(parse_activation("gelu"), Activation::gelu);
  EXPECT_EQ(parse_activation("swiglu"), Activation::swiglu);
  for (Formulation f : {Formulation::dropping, Formulation::padded, Formulation::dropless}) {
    EXPECT_EQ(parse_formulation(to_string(f)), f);
  }
  try {
    parse_formulation("Dropless");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("dropping, padded, dropless"), std::string::npos) << e.what();
  }
  try {
    parse_activation("relu");
    FAIL();
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("gelu, swiglu"), std::string::npos) << e.what();
  }
}

// ---- the JSON form in run.json ----

TEST(MoeConfigJson, RoundTrips) {
  MoeConfig c = valid_config(Formulation::padded);
  c.activation = Activation::swiglu;
  c.capacity_factor = 1.25;
  c.jitter_eps = 0.01;
  c.seed = 1234567890123ull;
  c.aux_loss_coef = 0.01;
  c.renormalize = true;
  const nlohmann::json j = c;
  EXPECT_EQ(j["formulation"], "padded");
  EXPECT_EQ(j["activation"], "swiglu");
  const MoeConfig back = nlohmann::json::parse(j.dump()).get<MoeConfig>();
  EXPECT_EQ(nlohmann::json(back), j);
}

TEST(MoeConfigJson, NanCapacityFactorOfDroplessSurvivesAsNull) {
  MoeConfig c = valid_config(Formulation::dropless);
  c.capacity_factor = std::numeric_limits<double>::quiet_NaN();
  const nlohmann::json j = nlohmann::json::parse(nlohmann::json(c).dump());
  EXPECT_TRUE(j["capacity_factor"].is_null());
  EXPECT_TRUE(std::isnan(j.get<MoeConfig>().capacity_factor));
  nlohmann::json dropping = j;
  dropping["formulation"] = "dropping";  // there a NaN capacity factor is invalid
  EXPECT_THROW(dropping.get<MoeConfig>(), RecordError);
}

TEST(MoeConfigJson, FromJsonChecksPresenceTypesAndValidity) {
  nlohmann::json j = valid_config();
  auto expect_error = [](const nlohmann::json& bad, const std::string& needle) {
    try {
      bad.get<MoeConfig>();
      FAIL() << "accepted " << bad.dump();
    } catch (const RecordError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  nlohmann::json missing = j;
  missing.erase("num_experts");
  expect_error(missing, "num_experts");
  nlohmann::json wrong_type = j;
  wrong_type["top_k"] = "2";
  expect_error(wrong_type, "top_k");
  nlohmann::json invalid = j;
  invalid["top_k"] = 99;
  expect_error(invalid, "top_k");
  nlohmann::json bad_name = j;
  bad_name["formulation"] = "sparse";
  expect_error(bad_name, "dropping, padded, dropless");
  expect_error(nlohmann::json::array(), "object");
}

}  // namespace
}  // namespace moe
