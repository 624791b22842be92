// Uses the installed flashmix through find_package: a bad argument must come
// back as an error that names it.
#include <cstdio>
#include <flashmix/moe.h>

int main() {
  flashmix::FinalizeMoeRoutingArgs args;
  args.num_tokens = 4;
  args.hidden = 8;
  args.k = 2;
  args.num_experts_per_node = 2;
  flashmix::Status s = flashmix::finalize_moe_routing_cpu(args);
  std::printf("%s\n", s.message().c_str());
  return (!s.ok() && s.message().find("out: is null") != std::string::npos) ? 0 : 1;
}
