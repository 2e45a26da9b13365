// STUB for syntax checking only, not CANN.
// Test driver for omforge's generated ONNX plugins, built by tests/test_atc.py together with the plugin sources
// (one translation unit: it #includes the files named by -DOMFORGE_PLUGINS_UNITY), the stub CANN headers of
// this folder and a real nlohmann/json.hpp. Usage: plugin_harness <onnx key> <"attribute" JSON>
// It finds the registration of the key, calls its parse function on an operator carrying the JSON exactly as
// ATC's parser would hand it over, and prints "status <n>", "ge_type <T>" and each GE attribute set.
#include <cstdio>
#include <string>
#include <variant>

#include OMFORGE_PLUGINS_UNITY

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s <onnx key> <attribute json>\n", argv[0]);
    return 2;
  }
  for (const domi::Registration& reg : domi::Registrations()) {
    for (const std::string& key : reg.origin_types) {
      if (key != argv[1]) {
        continue;
      }
      ge::Operator src("node", argv[1]);
      src.SetAttr("attribute", argv[2]);
      ge::Operator dst("node", reg.om_type.c_str());
      const domi::Status status = reg.parse(src, dst);
      std::printf("status %u\nge_type %s\nonnx %d\ntvm %d\n", status, reg.om_type.c_str(), reg.onnx, reg.tvm);
      for (const auto& [name, value] : dst.Attrs()) {
        if (std::holds_alternative<float>(value)) {
          std::printf("float %s %.9g\n", name.c_str(), static_cast<double>(std::get<float>(value)));
        } else if (std::holds_alternative<int64_t>(value)) {
          std::printf("int %s %lld\n", name.c_str(), static_cast<long long>(std::get<int64_t>(value)));
        } else {
          std::printf("string %s %s\n", name.c_str(), std::get<std::string>(value).c_str());
        }
      }
      return 0;
    }
  }
  std::printf("unregistered %s\n", argv[1]);
  return 3;
}
