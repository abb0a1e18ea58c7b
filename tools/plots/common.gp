# common.gp - what every figure shares: SVG output, the CSV format the
# benchmark tools write (util/csvout.h: '#' preamble, a header of column
# names), and a footer quoting the machine and the command, passed in by
# tools/plots.sh as the strings machine, date and command.
set terminal svg size 900,600 dynamic enhanced font "sans,12" background "white"
set output out
set datafile separator ","
set datafile columnheaders
# rows of other series come out NaN in a "using" expression; missing, not a break in the line
set datafile missing NaN
set grid
set key top left box opaque
set bmargin 8
# a long command goes on two lines, cut at a space
command1 = "command: ".command
command2 = ""
if (strlen(command1) > 120) {
    cut = 120
    while (cut > 10 && command1[cut:cut] ne " ") { cut = cut - 1 }
    command2 = "    ".command1[cut + 1:]
    command1 = command1[1:cut - 1]
}
set label 901 "machine: ".machine." (".date.")" at screen 0.01, screen 0.075 font "sans,9" noenhanced
set label 902 command1 at screen 0.01, screen 0.045 font "sans,9" noenhanced
set label 903 command2 at screen 0.01, screen 0.018 font "sans,9" noenhanced
